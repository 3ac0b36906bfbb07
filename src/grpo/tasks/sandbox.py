"""Running untrusted Python in bubblewrap (`bwrap`, Debian package `bubblewrap`): the process the code reward
(grpo.tasks.code_reward) grades model-written programs in.

What the program sees and may do (docs/own_task.md, "Code rewards in a sandbox"):
- no network: a network namespace of its own (loopback only, nothing of the host's);
- a read-only file system of the OS's /usr and the interpreter's prefix; no /etc, /home, /root, /tmp or the run's
  files; the one writable place is /box (its working directory), a fresh tmpfs of `box_bytes`;
- one process: a seccomp filter refuses fork, vfork and clone without CLONE_THREAD (threads may run). RLIMIT_NPROC
  would not do: the kernel does not enforce it for root, and CI runs as root;
- limits set by `prlimit` before Python starts: address space (`memory_bytes`), CPU seconds, file size, open files,
  no core dumps; and `timeout_s` of wall clock, after which the whole sandbox (its own pid namespace) is killed;
- at most `output_bytes` of stdout and of stderr kept (the rest read and dropped).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) on a "
                "kernel that allows user namespaces (sysctl kernel.unprivileged_userns_clone=1 where it exists)")

# Runs inside the sandbox as `python -I -S -c HARNESS <token>`: reads {nonce, program, tests} from stdin, runs the
# program as module `solution`, then the tests in its namespace, and only then prints the verdict line. A program that
# exits early (sys.exit(0), os._exit(0)) or prints "ok" never prints the nonce it was not shown.
HARNESS = """
import json, sys
def _main():
    job = json.loads(sys.stdin.read())
    sys.stdin = open("/dev/null")
    scope = {"__name__": "solution"}
    exec(compile(job.pop("program"), "solution.py", "exec"), scope)
    exec(compile(job.pop("tests"), "tests.py", "exec"), scope)
    sys.stdout.flush()
    sys.stdout.write("\\n" + job["nonce"] + " passed\\n")
    sys.stdout.flush()
_main()
"""


class SandboxError(RuntimeError):
    """bwrap itself failed to start a sandbox for one run (not the program's fault: it never ran)."""


class SandboxUnavailable(RuntimeError):
    """bwrap (or prlimit) is missing, or this kernel refuses the namespaces it needs: the code reward cannot run."""


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds of one sandboxed run."""

    timeout_s: float = 2.0
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 64 * 2**10
    box_bytes: int = 16 * 2**20
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    """What one run did: whether its tests passed (the harness's verdict line), how it ended, its captured output."""

    passed: bool
    returncode: Optional[int]
    timed_out: bool
    stdout: str
    stderr: str
    output_truncated: bool
    seconds: float
    # In the command line of every process of the run (tests look for leftovers by it).
    token: str


# ---------------------------------------------------------------- seccomp: no new processes
_AUDIT_ARCH = {"x86_64": (0xC000003E, {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435}),
               "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435})}
_RET_ALLOW, _RET_KILL, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS, _CLONE_THREAD = 1, 38, 0x00010000
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


def no_fork_filter(machine: Optional[str] = None) -> bytes:
    """A classic-BPF seccomp program (bwrap --seccomp) that lets a process make threads but no other process: fork
    and vfork fail with EPERM, clone without CLONE_THREAD with EPERM, clone3 with ENOSYS (glibc then falls back to
    clone, whose flags the filter can read); any other architecture's system calls (i386, x32) kill the process."""
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        raise SandboxUnavailable(f"the code sandbox's seccomp filter knows x86_64 and aarch64, not {machine}")
    arch, nr = _AUDIT_ARCH[machine]
    # (code, jump-if-true label, jump-if-false label, k); labels are resolved to relative offsets below.
    prog: list[tuple[int, str, str, int]] = [(_LD_W_ABS, "", "", 4), (_JEQ_K, "", "kill", arch),
                                             (_LD_W_ABS, "", "", 0)]
    if machine == "x86_64":
        prog.append((_JGE_K, "kill", "", 0x40000000))  # the x32 ABI's numbers
    for name in ("fork", "vfork"):
        if name in nr:
            prog.append((_JEQ_K, "eperm", "", nr[name]))
    prog += [(_JEQ_K, "enosys", "", nr["clone3"]), (_JEQ_K, "", "allow", nr["clone"]),
             (_LD_W_ABS, "", "", 16), (_JSET_K, "allow", "eperm", _CLONE_THREAD)]
    labels = {"allow": _RET_ALLOW, "eperm": _RET_ERRNO | _EPERM, "enosys": _RET_ERRNO | _ENOSYS, "kill": _RET_KILL}
    at = {name: len(prog) + i for i, name in enumerate(labels)}
    out = b""
    for i, (code, jt, jf, k) in enumerate(prog):
        jump_true, jump_false = (at[label] - i - 1 if label else 0 for label in (jt, jf))
        out += struct.pack("=HBBI", code, jump_true, jump_false, k)
    return out + b"".join(struct.pack("=HBBI", _RET_K, 0, 0, k) for k in labels.values())


# ---------------------------------------------------------------- the command
def _interpreter() -> tuple[str, str]:
    """The Python that runs the programs (the one running this process, outside any virtualenv) and its prefix."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _view_args(prefix: str) -> list[str]:
    """bwrap's file-system view: /usr and the interpreter's prefix read-only, the usual top-level links into /usr."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return args


def sandbox_command(limits: SandboxLimits, seccomp_fd: int, info_fd: int, token: str) -> list[str]:
    """The bwrap command line of one run (the filter read from `seccomp_fd`, bwrap's info written to `info_fd`;
    `token` names the run)."""
    python, prefix = _interpreter()
    cpu_s = int(limits.timeout_s) + 1
    return ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns",
            "--cap-drop", "ALL",
            *_view_args(prefix), "--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc",
            "--size", str(limits.box_bytes), "--tmpfs", "/box", "--remount-ro", "/", "--chdir", "/box",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/box", "--setenv", "TMPDIR", "/box",
            "--setenv", "LANG", "C.UTF-8", "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd), "--",
            "prlimit", f"--as={limits.memory_bytes}", f"--cpu={cpu_s}", f"--fsize={limits.box_bytes}",
            f"--nofile={limits.open_files}", "--core=0", "--",
            python, "-I", "-S", "-B", "-c", HARNESS, token]


def _sandbox_init_pid(info: bytes) -> Optional[int]:
    """The host pid of the sandbox's pid 1 (bwrap --info-fd writes {"child-pid": N}); None if bwrap wrote none."""
    try:
        return int(json.loads(info.decode())["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _kill_tree(proc: subprocess.Popen, init_pid: Optional[int], token: str) -> None:
    """SIGKILL the sandbox's pid 1 (the kernel then kills every process of its pid namespace, and pid 1's exit waits
    for them) and wait for that exit; then bwrap's own process group. The pid is signalled through a pidfd, and only
    when that process's command line holds `token`: a pid freed by a sandbox that ended and reused is left alone."""
    if init_pid is not None:
        try:
            pidfd = os.pidfd_open(init_pid)
        except ProcessLookupError:
            pidfd = None
        if pidfd is not None:
            try:
                with open(f"/proc/{init_pid}/cmdline", "rb") as f:
                    ours = token.encode() in f.read()
                if ours:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    with selectors.DefaultSelector() as sel:
                        sel.register(pidfd, selectors.EVENT_READ)
                        sel.select(10.0)
            except (ProcessLookupError, FileNotFoundError):
                pass
            finally:
                os.close(pidfd)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _collect(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the wall clock runs out or either passes `output_bytes`: (stdout,
    stderr, truncated, timed out), each stream cut at `output_bytes`."""
    deadline = time.monotonic() + limits.timeout_s
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for stream in kept:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.fileobj]
                room = limits.output_bytes - len(buf)
                buf += chunk[:max(room, 0)]
                if len(chunk) > room:  # over the limit: the run has failed, no need to wait for the rest
                    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), True, False
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), False, timed_out


def run_sandboxed(program: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `program` then `tests` (Python source; the tests assert on the program's names) in the sandbox. `passed`
    is true only when every test ran to the end within the limits and the output was not truncated. Raises
    SandboxUnavailable where bwrap cannot run here, SandboxError when it failed to start this run."""
    check_sandbox()
    return _run(program, tests, limits)


def _run(program: str, tests: str, limits: SandboxLimits) -> SandboxResult:
    nonce, token = secrets.token_hex(16), f"grpo-sandbox-{secrets.token_hex(8)}"
    seccomp_r, seccomp_w = os.pipe()
    os.write(seccomp_w, no_fork_filter())
    os.close(seccomp_w)
    info_r, info_w = os.pipe()
    init_pid: Optional[int] = None
    start = time.monotonic()
    try:
        proc = subprocess.Popen(sandbox_command(limits, seccomp_r, info_w, token), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(seccomp_r, info_w),
                                start_new_session=True)
    finally:
        os.close(seccomp_r)
        os.close(info_w)
    try:
        # bwrap writes the info and closes its end before it runs the program.
        with os.fdopen(info_r, "rb") as info:
            init_pid = _sandbox_init_pid(info.read())
        try:
            proc.stdin.write(json.dumps({"nonce": nonce, "program": program, "tests": tests}).encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading: its output says why
            pass
        out, err, truncated, timed_out = _collect(proc, limits)
    finally:
        _kill_tree(proc, init_pid, token)
        returncode = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    if init_pid is None:  # bwrap failed before the sandbox existed: no fault of the program's
        raise SandboxError(f"bwrap did not start the sandbox (exit status {returncode}): "
                           f"{err.decode('utf-8', 'replace').strip()[-500:]}")
    text = out.decode("utf-8", "replace")
    last = text.rstrip("\n").rsplit("\n", 1)[-1]
    passed = not timed_out and not truncated and returncode == 0 and last == f"{nonce} passed"
    return SandboxResult(passed, None if timed_out else returncode, timed_out, text, err.decode("utf-8", "replace"),
                         truncated, time.monotonic() - start, token)


@lru_cache(maxsize=1)
def _probe() -> Optional[str]:
    """None when the sandbox runs a test program here (the very command every run uses), else why not."""
    for tool in ("bwrap", "prlimit"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    try:
        result = _run("ok = True\n", "assert ok\n", SandboxLimits(timeout_s=30.0))
    except (OSError, SandboxError, SandboxUnavailable) as e:
        return str(e)
    if not result.passed:
        return f"a test program did not pass in it ({(result.stderr or result.stdout).strip()[-500:]})"
    return None


def check_sandbox() -> None:
    """Raise SandboxUnavailable, saying what to install, unless bwrap can run a sandbox on this machine."""
    why = _probe()
    if why is not None:
        raise SandboxUnavailable(f"the code sandbox cannot run: {why}; {INSTALL_HINT}. Programs are never run "
                                 "outside the sandbox")

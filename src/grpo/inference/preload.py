"""vLLM's API server imported while the trainer starts: one preloaded server process per command.

A run's vLLM server spends its first seconds importing (`import vllm.entrypoints.openai.api_server`: ~9 s on a 2-core
CPU, ~18 s on a GPU host; bench/gpu/README.md), and the trainer launches it only once its own imports, the config
and its checks are done. `start` (the first line of the `grpo-train` command, grpo.command) starts
`python -m grpo.inference.preloaded_server` at once: it imports the server's modules beside the trainer's imports
and waits. The first `VLLMServer.start` of the run hands it the server's command line, environment and log
(`take`, `PreloadedServer.launch`), and it runs `grpo.inference.server.main` as the launched process would: same
arguments, environment, working directory, log, process group and tie to the launcher.

When the preload cannot stand for a fresh launch, the server starts afresh (what the run's log says): a launch
environment that differs from the command's in a variable read while importing (`import_blockers`) is launched
as usual; an import that failed or touched CUDA makes the preloaded process replace itself with the fresh server
(exec, same pid). A run that launches no server stops the preload once it knows (`discard`); so does the process's
exit. Off with `GRPO_PRELOAD_SERVER=0`; never under torchrun, in a multirun, for a command that only prints, or for
a run given its servers on the command line (`server.external_url(s)=`).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, Sequence

from grpo.inference.launch_args import TORCHRUN_VARS, die_with_parent

log = logging.getLogger(__name__)

# `GRPO_PRELOAD_SERVER=0` turns the preload off (it is decided before any config exists).
ENABLE_ENV = "GRPO_PRELOAD_SERVER"
# The module the preloaded process runs, and the one it stands in for.
PRELOADED_MODULE = "grpo.inference.preloaded_server"
SERVER_MODULE = "grpo.inference.server"
# Variables the launcher sets that vLLM and grpo read when the server runs, not while its modules import:
# CUDA_VISIBLE_DEVICES is read at CUDA's initialisation (the preloaded process checks that its import did not
# initialise it), OMP_NUM_THREADS applied when handed over (torch.set_num_threads), vLLM's multiprocessing and LoRA
# switches when the engine starts, VLLM_PLUGINS' general plugins when the engine loads them, grpo's own (GRPO_*)
# by the server's code; torch sets its compile caches' folders itself when it first compiles in the trainer, and
# reads them when it compiles. Any other difference means a fresh start.
RUN_TIME_VARS = frozenset({
    "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
})
RUN_TIME_PREFIX = "GRPO_"
# What the server's log says when the preloaded process runs the server (grpo.inference.preloaded_server).
PRELOADED_NOTE = "grpo: this server's modules were imported before its launch (grpo.inference.preload)"
# Command-line flags after which the command prints and exits (Hydra's help and config views) or runs jobs that
# each launch their own server (a multirun): no server of this process to preload.
NO_PRELOAD_FLAGS = frozenset({"-h", "--help", "--hydra-help", "-c", "--cfg", "--info", "--resolve", "-m",
                              "--multirun", "--shell-completion", "-sc"})
# The launch message's pipe (Linux's default pipe-max-size): the launcher's write never waits on the import.
PIPE_BYTES = 1 << 20
# Overrides that give the run servers started elsewhere: it launches none.
GIVEN_SERVER_KEYS = frozenset({"server.external_url", "server.external_urls"})


def import_blockers(start_env: Mapping[str, str], launch_env: Mapping[str, str]) -> list[str]:
    """The variables whose value differs between the environment the preloaded process imported under and the one
    the server is launched with, other than those read only at run time (`RUN_TIME_VARS`, GRPO_*)."""
    keys = set(start_env) | set(launch_env)
    return sorted(k for k in keys if start_env.get(k) != launch_env.get(k)
                  and k not in RUN_TIME_VARS and not k.startswith(RUN_TIME_PREFIX))


def wanted(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the command `argv` (its arguments) with `env` should preload a server: not when turned off, under
    torchrun (ranks other than 0 launch none, and rank 0's environment loses torchrun's variables), in a multirun,
    for a command that only prints, or for a run given its servers on the command line."""
    if env.get(ENABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if env.get("WORLD_SIZE", "1") not in ("", "1"):
        return False
    names = {a.split("=", 1)[0].lstrip("+") for a in argv}  # `~server.external_url` removes it: a server to launch
    return not (names & NO_PRELOAD_FLAGS or names & GIVEN_SERVER_KEYS)


@dataclass
class PreloadedServer:
    """The preloaded process (its own session, tied to the launcher like a launched server), the environment it
    imported under, when it started (time.monotonic()) and the file holding its output until it has a log."""

    proc: subprocess.Popen
    env: dict[str, str]
    started_at: float
    output: IO[bytes]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def launch(self, command: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
        """Hand over the server's command line (`[python, -m, grpo.inference.server, *args]`), environment and log
        (one JSON line on its stdin: the run token in the environment never touches the disk); the returned process
        is the server from now on (its pid is the preloaded process's)."""
        message = {"args": list(command[3:]), "env": dict(env), "log": str(log_path), "cwd": os.getcwd(),
                   "sent_at": time.time()}
        assert self.proc.stdin is not None
        try:  # the pipe holds it while the process still imports (`start` widened the pipe for large environments)
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # it died since `take` looked: the launch's health wait reports its exit
            pass
        self.output.close()  # the process holds its own handle
        return self.proc

    def stop(self) -> None:
        """Stop the process (its whole session) and wait for it."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for stream in (self.proc.stdin, self.output):
            if stream is not None and not stream.closed:
                stream.close()


_preloaded: PreloadedServer | None = None


def start(argv: Sequence[str]) -> bool:
    """Start the preloaded server process for this command (`argv`: its arguments) unless `wanted` says not to;
    True when started. Call it before the trainer's own imports: they then run side by side."""
    global _preloaded
    if _preloaded is not None or not wanted(argv, os.environ):
        return False
    output = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", PRELOADED_MODULE], stdin=subprocess.PIPE, stdout=output,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
    try:  # the launch message waits in the pipe until the import is done: room for an environment of up to 1 MiB
        fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # above the system's pipe-max-size: a larger message only waits for the import to end
        pass
    _preloaded = PreloadedServer(proc=proc, env=dict(os.environ), started_at=time.monotonic(), output=output)
    atexit.register(discard)
    return True


def take(command: Sequence[str], env: Mapping[str, str]) -> PreloadedServer | None:
    """The preloaded process, once, when it can run `command` with `env`; None when there is none or it cannot
    (then it is stopped and the reason logged: the caller launches afresh)."""
    global _preloaded
    preloaded, _preloaded = _preloaded, None
    if preloaded is None:
        return None
    why = None
    if list(command[:3]) != [sys.executable, "-m", SERVER_MODULE]:
        why = f"the launch runs {' '.join(command[:3])}, not {SERVER_MODULE}"
    elif not preloaded.alive():
        why = f"it exited with code {preloaded.proc.returncode} while importing"
    else:
        blockers = import_blockers({k: v for k, v in preloaded.env.items() if k not in TORCHRUN_VARS}, env)
        if blockers:
            why = f"the server's environment differs in {', '.join(blockers[:5])}, read while vLLM imports"
    if why is not None:
        log.info("vLLM's preloaded import is not used (%s); launching the server afresh", why)
        preloaded.stop()
        return None
    return preloaded


def running_pid() -> int | None:
    """The pid of this process's preloaded server process while it runs and no launch took it, else None."""
    return _preloaded.proc.pid if _preloaded is not None and _preloaded.alive() else None


def discard() -> None:
    """Stop the preloaded process if no launch took it (a run that launches no server, the process's exit)."""
    global _preloaded
    preloaded, _preloaded = _preloaded, None
    if preloaded is not None:
        preloaded.stop()


def launch(command: Sequence[str], env: Mapping[str, str], log_path: Path,
           log_file: IO[bytes]) -> tuple[subprocess.Popen, float | None]:
    """The server's process for `command` with `env`: the preloaded one when `take` allows, else a new one writing
    to `log_file`; both in a session of their own, tied to the launcher (`die_with_parent`). Also when its imports
    began (time.monotonic()) for a preloaded one, else None."""
    preloaded = take(command, env)
    if preloaded is not None:
        return preloaded.launch(command, env, log_path), preloaded.started_at
    proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env),
                            start_new_session=True, preexec_fn=die_with_parent)
    return proc, None

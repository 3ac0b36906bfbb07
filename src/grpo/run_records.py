"""What a run leaves behind besides metrics and its summary (grpo.run_summary): provenance (version, commit, the run's
identity that a resume must match) and, for GPU jobs, device_memory.json (with the release of device memory between
multirun jobs); and who owns the run dir: this process's lock on it, a dir it created and discards when the run never
started, earlier sessions' records moved aside, all done by the Hydra callback `RunDirGuard` before Hydra writes
there."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

import torch
from hydra.experimental.callback import Callback

from grpo.config.run_dir import (
    check_resume_exists,
    check_resume_has_steps_left,
    check_run_dir,
    check_run_dir_unused,
    check_sweep_dir_unused,
    held_run,
)
from grpo.config_values import ConfigError

log = logging.getLogger(__name__)


def git_commit(cwd: Path | None = None) -> str | None:
    """Commit of the checkout the code runs from, with '-dirty' when it has uncommitted changes."""
    here = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


# What a run is (its model, mode and data) and what its checkpoints' state is shaped by (the optimizer class, the
# trained layers, the LoRA adapter's shape): a resume must compose the same (check_resume_identity). Before the last
# four were checked, a resume with another optimizer or layers failed after vLLM's start-up, in torch's
# load_state_dict or the first optimizer step, with a traceback naming no setting.
IDENTITY_KEYS = ("model.name", "model.offline", "model.num_layers", "mode._target_", "data._target_",
                 "data.task._target_", "optimizer._target_", "layers.indices", "lora.r", "lora.target_modules")


def run_identity(cfg: Any) -> dict[str, Any]:
    """The IDENTITY_KEYS of a composed config (None where a key is absent; lists as lists)."""
    from omegaconf import OmegaConf

    values = {key: OmegaConf.select(cfg, key, default=None) for key in IDENTITY_KEYS}
    return {key: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for key, v in values.items()}


def check_resume_identity(cfg: Any) -> None:
    """`train.resume` of a run trained on another model, mode or data (e.g. resumed without the overrides it was
    started with, so the default job composes) would continue it on those, silently; with another optimizer class,
    layers or LoRA shape its checkpoint does not load: refuse (IDENTITY_KEYS), naming the keys and the run's own
    command line (its provenance.json, read before this run rewrites it)."""
    resume = cfg.train.resume
    path = Path(resume) / "provenance.json" if resume is not None else None
    if path is None or not path.exists():
        return
    earlier = json.loads(path.read_text())
    before, now = earlier.get("identity") or {}, run_identity(cfg)
    differ = [k for k in IDENTITY_KEYS if k in before and before[k] != now[k]]
    if differ:
        was = ", ".join(f"{k}={before[k]}" for k in differ)
        given = ", ".join(f"{k}={now[k]}" for k in differ)
        # The run's own command with this resume (a command that resumed already carries a train.resume of its own).
        command = [a for a in earlier.get("argv", []) if not a.lstrip("+").startswith("train.resume=")]
        if command and command[0].endswith(".py"):
            command.insert(0, "python")  # argv[0] is the script; the command to type runs it with python
        raise ConfigError(
            f"train.resume={resume} was trained with {was}, but this command composes {given}; resume with the "
            f"run's own settings: {shlex.join([*command, f'train.resume={resume}'])}"
        )


def record_provenance(run_dir: Path, cfg: Any = None) -> dict:
    """Write provenance.json: package version, git commit, python, command line and the run's identity (model,
    mode, data) when `cfg` is given."""
    try:
        pkg = version("grpo")
    except PackageNotFoundError:
        pkg = None
    info = {"grpo_version": pkg, "git_commit": git_commit(), "python": sys.version.split()[0], "argv": sys.argv}
    if cfg is not None:
        info["identity"] = run_identity(cfg)
        if cfg.train.resume is not None:  # read by grpo.config.run_dir.resumed_from: which run this one continues
            info["resumed_from"] = str(Path(cfg.train.resume).resolve())
    (run_dir / "provenance.json").write_text(json.dumps(info, indent=2))
    return info


def device_memory() -> dict[str, float] | None:
    """GiB in use on this process's GPU, device-wide (every process: the server included) and by this process's
    allocator; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"device_used_gb": (total - free) / 1024**3, "allocated_gb": torch.cuda.memory_allocated() / 1024**3,
            "reserved_gb": torch.cuda.memory_reserved() / 1024**3}


def release_device_memory() -> None:
    """Collect reference cycles and hand the allocator's free blocks back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def record_device_memory(run_dir: Path, before: dict[str, float], settle_s: float = 10.0) -> None:
    """`<run_dir>/device_memory.json`: device memory at the job's start and after its teardown (the GPU suite checks
    the two agree within 1 GiB). The driver frees a stopped server's memory shortly after its processes exit, so
    the reading after waits up to `settle_s` for the device to come back within 1 GiB of the start. A run dir
    discarded after a start-up mistake (`discard_unstarted_run_dir`) gets nothing: writing there would replace the
    mistake's message with a FileNotFoundError (seen on a GPU, 2026-11-27)."""
    if not run_dir.is_dir():
        return
    deadline = time.monotonic() + settle_s
    after = device_memory()
    while after["device_used_gb"] > before["device_used_gb"] + 1.0 and time.monotonic() < deadline:
        time.sleep(0.5)
        after = device_memory()
    (run_dir / "device_memory.json").write_text(json.dumps({"before": before, "after_teardown": after}, indent=2))
    log.info("device memory: %.2f GiB in use before the job, %.2f GiB after its teardown",
             before["device_used_gb"], after["device_used_gb"])


# The open lock file of this process's run dir (`lock_run_dir`): the lock lasts as long as the process.
_run_dir_lock: Any = None


def keep_earlier_session(run_dir: Path) -> Path | None:
    """Before a resume writes its own `.hydra/` and `provenance.json` into `run_dir`, move the earlier session's
    into `run_dir/sessions/NN/` (01 the first session, then in order), so every session's config and command stay
    with the run. Returns that dir, or None when there was nothing to keep."""
    record = [p for p in (run_dir / ".hydra", run_dir / "provenance.json") if p.exists()]
    if not record:
        return None
    sessions = run_dir / "sessions"
    sessions.mkdir(exist_ok=True)
    taken = [int(d.name) for d in sessions.iterdir() if d.is_dir() and d.name.isdigit()]
    dest = sessions / f"{max(taken, default=0) + 1:02d}"
    dest.mkdir()
    for p in record:
        p.rename(dest / p.name)
    return dest


def keep_earlier_server_log(run_dir: Path) -> Path | None:
    """Before this session's server writes `logs/vllm.log` (appended to across its restarts), move an earlier
    session's to `logs/vllm.<n>.log` (1 the first, then in order): appended across resumes, a resumed run's start-up
    progress lines quoted the previous run's last messages. The other replicas' logs (`vllm-replica<i>.log`) move the
    same way. Returns where `vllm.log` went, or None when there was none."""
    logs = run_dir / "logs"
    for replica_log in sorted(logs.glob("vllm-replica*.log")):
        if "." not in replica_log.stem:  # this session's name, not an earlier one's vllm-replica<i>.<n>.log
            _keep_earlier(replica_log)
    current = logs / "vllm.log"
    return _keep_earlier(current) if current.is_file() else None


def _keep_earlier(current: Path) -> Path:
    """Move `<name>.log` to `<name>.<n>.log`, n one past the highest taken."""
    name = current.stem
    taken = [int(p.stem.split(".", 1)[1]) for p in current.parent.glob(f"{name}.*.log")
             if p.stem.split(".", 1)[1].isdigit()]
    dest = current.with_name(f"{name}.{max(taken, default=0) + 1}.log")
    current.rename(dest)
    return dest


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive lock on `<run_dir>/.grpo.lock` until this process ends (the file is removed then). A second
    trainer in the same dir (a resume command run twice, a requeued job) would write the same metrics.jsonl and
    checkpoints: it gets a ConfigError naming the holder instead."""
    import atexit
    import fcntl

    global _run_dir_lock
    path = (run_dir / ".grpo.lock").resolve()
    if _run_dir_lock is not None and Path(_run_dir_lock.name) == path:
        return  # this process holds it already
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ConfigError(f"run dir {run_dir} is in use by a running trainer ({holder}); wait for it to end or "
                              "stop it, or start this run in another dir (hydra.run.dir=...)") from None
        # The holder removes the file when it lets go: a lock taken on the removed file holds nothing, take the new.
        if path.exists() and os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
            break
        f.close()
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    unlock_run_dir()  # another run dir earlier in this process (tests): let it go
    _run_dir_lock = f
    atexit.unregister(unlock_run_dir)  # once, however many run dirs this process locks
    atexit.register(unlock_run_dir)


def unlock_run_dir() -> None:
    """Let go of the run dir lock this process holds, if any, and remove its file: a finished run dir has no
    `.grpo.lock` naming a dead pid (a killed trainer's stays, and takes a new holder at once)."""
    global _run_dir_lock
    if _run_dir_lock is not None:
        with contextlib.suppress(OSError):  # removed before the lock is let go: no one takes the old file meanwhile
            os.unlink(_run_dir_lock.name)
        _run_dir_lock.close()
        _run_dir_lock = None


# The run dir this process created (RunDirGuard, before Hydra writes into it) and the topmost of its parents it
# created with it (outputs/<date>/ for the first run of a day), for discard_unstarted_run_dir.
_created_run_dir: Path | None = None
_created_top: Path | None = None


def first_missing(path: Path) -> Path | None:
    """The topmost directory of `path` (itself included) that does not exist yet; None when it exists."""
    missing = None
    for candidate in [path.absolute(), *path.absolute().parents]:
        if candidate.exists():
            break
        missing = candidate
    return missing


def claim_new_run_dir(run_dir: Path) -> Path | None:
    """Create `run_dir` when it does not exist and return the topmost dir this process created for it (itself or a
    parent), or None when it existed already or another process created it first (two trainers started at once: only
    the one whose `mkdir` made it may discard it). An unwritable parent is left to `check_run_dir` to report."""
    top = first_missing(run_dir)
    if top is None:
        return None
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()
    except OSError:  # FileExistsError: another process made it first; any other, check_run_dir reports
        return None
    return top


def locked_by_another(run_dir: Path) -> bool:
    """Whether another process holds `run_dir`'s lock (`lock_run_dir`): a running trainer's dir."""
    import fcntl

    path = (run_dir / ".grpo.lock").resolve()
    if _run_dir_lock is not None and Path(_run_dir_lock.name) == path:
        return False
    try:
        f = open(path)
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def discard_unstarted_run_dir(run_dir: Path) -> bool:
    """Remove `run_dir` when this process created it and the run stopped at start-up, before any metrics row or
    checkpoint (a mistake in the command line, a missing file or model): such dirs piled up under outputs/ with a
    `.hydra/` and a train.log, some with a summary.json saying `failed`, for runs that never ran. A dir that existed
    before (a resume in place, a given hydra.run.dir) is kept as it is. True when removed."""
    global _created_run_dir
    if _created_run_dir is None or not run_dir.is_dir() or run_dir.resolve() != _created_run_dir.resolve():
        return False
    if held_run(run_dir)[0] or locked_by_another(run_dir):  # the other trainer of a race owns it now
        return False
    unlock_run_dir()
    shutil.rmtree(run_dir, ignore_errors=True)
    # Parents created with it go too while empty (another run may have started in the same date dir meanwhile).
    top = (_created_top or run_dir).absolute()
    for parent in run_dir.absolute().parents:
        if top not in (parent, *parent.parents):
            break
        try:
            parent.rmdir()
        except OSError:
            break
    _created_run_dir = None
    return True


class RunDirGuard(Callback):
    """Hydra callback (conf/train.yaml, hydra.callbacks): before a single run's job starts, refuse a run dir that
    holds another run (`check_run_dir_unused`), a resume path that does not exist, a resume dir without a checkpoint
    or steps left, and a resume of another model, mode, data, optimizer class, layers or LoRA shape
    (`check_resume_identity`); before a sweep's first job, a sweep dir whose jobs already ran. train.py checks each
    job too, but only after Hydra has written the job's `.hydra/` (config, overrides) into its dir, over the earlier
    run's own record."""

    @staticmethod
    @contextlib.contextmanager
    def _checking(config: Any) -> Iterator[None]:
        """Hydra's config set (the run and sweep dirs' interpolations read it; run_job sets it again), and a
        ConfigError raised inside turned into its one-line message and exit 1."""
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)
        try:
            yield
        except ConfigError as e:
            discard_unstarted_run_dir(Path(config.hydra.run.dir))  # only one on_run_start created
            print(f"ConfigError: {e}", file=sys.stderr)
            raise SystemExit(1) from None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:  # noqa: ARG002
        """Exit 1 with the ConfigError's message, before Hydra writes anything into the run dir."""
        with self._checking(config):
            # The default run dir of a resume is train.resume: a missing path would be created, a checkpoint given
            # there would get .hydra/.
            check_resume_exists(config)
            if int(os.environ.get("RANK", "0")) == 0:
                global _created_run_dir, _created_top
                run_dir = Path(config.hydra.run.dir)
                top = claim_new_run_dir(run_dir)
                # Before Hydra opens train.log there: its failure was a traceback ending in "Unable to configure
                # handler 'file'", the cause (PermissionError ... train.log) buried in it.
                check_run_dir(run_dir)
                _created_run_dir, _created_top = (run_dir, top) if top is not None else (None, None)
            check_run_dir_unused(config, Path(config.hydra.run.dir))
            check_resume_has_steps_left(config)
            check_resume_identity(config)
            if int(os.environ.get("RANK", "0")) == 0:  # torchrun: rank 0 owns the run dir
                run_dir = Path(config.hydra.run.dir)
                lock_run_dir(run_dir)
                resume = config.train.resume
                if resume is not None and Path(resume).resolve() == run_dir.resolve():
                    keep_earlier_session(run_dir)  # before Hydra writes this session's .hydra/ over it
                keep_earlier_server_log(run_dir)  # one vllm.log per session

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:  # noqa: ARG002
        """Exit 1 before the first job when the sweep dir holds jobs that already ran (`check_sweep_dir_unused`)."""
        with self._checking(config):
            check_run_dir(Path(config.hydra.sweep.dir), "hydra.sweep.dir")  # its jobs' dirs and train.log files go there
            check_sweep_dir_unused(Path(config.hydra.sweep.dir))


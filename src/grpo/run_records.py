"""What a run leaves behind besides metrics: provenance (version, commit), summary.json and, for GPU jobs,
device_memory.json (with the release of device memory between multirun jobs)."""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator, Sequence

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
from grpo.trainer.metrics import read_metrics
from grpo.trainer.wall_clock import WallClock, describe

log = logging.getLogger(__name__)

# Rollout batches averaged for `first10_reward_mean` and `last10_reward_mean` (the objective sweeps optimise); a run
# of fewer than two windows averages half of its batches each (`reward_window`), so the two never overlap.
REWARD_WINDOW = 10


def reward_window(batches: int) -> int:
    """Rollout batches in each of the first and last reward means: REWARD_WINDOW, or half the run's batches when
    that is fewer (at least 1): with 15 batches (sweep=clip_eps) the first and last 10 shared 5, which read as less
    learning than there was."""
    return max(1, min(REWARD_WINDOW, batches // 2))


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


def steps_in(rows: Sequence[dict], default: int) -> int:
    """The last optimizer step of metrics rows (not rollout batches: with train.ppo_epochs x train.mini_batches > 1
    a batch has several); `default` when no row has one."""
    return max((int(r["step"]) for r in rows if r.get("step") is not None), default=default)


def earlier_wall_seconds(resumed: Path) -> float:
    """The wall-clock seconds of every session of the run a resume continues, from its summary.json (its
    `run_wall_seconds`, or `wall_seconds` of a summary that predates it); 0 when it has none (a session killed
    before writing one)."""
    try:
        summary = json.loads((resumed / "summary.json").read_text())
        return float(summary.get("run_wall_seconds", summary.get("wall_seconds")) or 0.0)
    except FileNotFoundError:
        return 0.0
    except (OSError, ValueError, TypeError, AttributeError) as e:
        log.warning("earlier sessions' wall time not counted: %s unreadable (%s)", resumed / "summary.json", e)
        return 0.0


class RunSummary:
    """Writes summary.json when a run ends, however it ends: `wall_seconds` is this session's wall-clock time,
    `run_wall_seconds` the whole run's (the earlier sessions' of a resumed run, `resumed` its run dir, added)."""

    def __init__(self, run_dir: Path, resumed: Path | None = None) -> None:
        self.path = run_dir / "summary.json"
        self.t0 = time.time()
        # Read now: a resume in place writes this session's summary over the earlier one.
        self.earlier_seconds = earlier_wall_seconds(resumed) if resumed is not None else 0.0

    def _write(self, data: dict) -> None:
        """Replace summary.json whole (a crash never leaves half of it); a failed write is logged, not raised: it
        runs inside the error handling of a failed run, whose own error must stay the one reported."""
        data["wall_seconds"] = time.time() - self.t0
        data["run_wall_seconds"] = self.earlier_seconds + data["wall_seconds"]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=2))
            os.replace(tmp, self.path)
        except OSError as e:
            log.error("could not write %s (status %s): %s", self.path, data.get("status"), e)

    def finish(self, rewards: list[float], wall_clock: WallClock | None = None) -> float | None:
        """Record a completed run; returns the mean reward of the last REWARD_WINDOW rollout batches.

        A run resumed in its own run dir counts every step of its metrics.jsonl, not only this session's `rewards`.
        `wall_clock`: where this session's wall clock went (summary.json's `wall_clock`, from the process's start).
        """
        rows = self._metric_rows()
        rewards = [float(r["reward/mean"]) for r in rows if r.get("reward/mean") is not None] or rewards
        steps = steps_in(rows, default=len(rewards))
        window = reward_window(len(rewards))
        last = sum(rewards[-window:]) / len(rewards[-window:]) if rewards else None
        first = sum(rewards[:window]) / len(rewards[:window]) if rewards else None
        data = {"status": "completed", "steps_run": steps, "rollout_batches": len(rewards),
                "last10_reward_mean": last, "first10_reward_mean": first, "reward_window": window,
                "best_reward": max(rewards) if rewards else None}
        if wall_clock is not None:
            data["wall_clock"] = wall_clock.summary()
        self._write(data)
        return last

    def _metric_rows(self) -> list[dict]:
        path = self.path.with_name("metrics.jsonl")
        return read_metrics(path) if path.exists() else []

    def skip(self, error: BaseException) -> None:
        """Record a sweep job skipped at start-up for its config (`grpo.report` shows it as skipped, with why). In a
        dir whose metrics.jsonl has rows, summary.json is another run's (the job was refused for holding it): kept."""
        metrics = self.path.with_name("metrics.jsonl")
        if metrics.exists() and metrics.stat().st_size > 0:
            return
        self._write({"status": "skipped", "error": f"{type(error).__name__}: {error}"})

    def fail(self, error: BaseException, wall_clock: WallClock | None = None) -> None:
        """Record a failed or interrupted run, with the steps its metrics.jsonl holds (0 before the first; None when
        that file cannot be read: the run's own error stays the one reported) and where its wall clock went."""
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        try:
            steps: int | None = steps_in(self._metric_rows(), default=0)
        except (OSError, ValueError) as e:  # MetricsFileError is a ValueError
            log.error("steps_run of %s unknown: %s", self.path, e)
            steps = None
        data = {"status": status, "steps_run": steps, "error": f"{type(error).__name__}: {error}",
                "traceback": "".join(traceback.format_exception(error))[-4000:]}
        if wall_clock is not None:
            data["wall_clock"] = wall_clock.summary()
        self._write(data)


def done_message(run_dir: Path) -> str:
    """The one line a completed run ends with: steps, reward and held-out accuracy from first to last, and where the
    outputs are (the run dir is otherwise named only among the start-up lines)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    parts = [f"run completed: {summary['steps_run']} steps"]
    first, last = summary.get("first10_reward_mean"), summary.get("last10_reward_mean")
    batches = summary.get("rollout_batches") or 0
    window = summary.get("reward_window") or reward_window(batches)
    if last is not None and batches < 2:
        # One batch is both the first and the last: "0.541 -> 0.541" read as no learning.
        parts.append(f"reward {last:.3f} (mean of its {batches} rollout batch{'es' if batches != 1 else ''})")
    elif last is not None:
        parts.append(f"reward {first:.3f} -> {last:.3f} (mean of the first and last {window} rollout "
                     f"batch{'es' if window != 1 else ''} of {batches})")
    # By step: evaluations beside training write their rows when they complete.
    evals = sorted((r for r in rows if r.get("eval/accuracy") is not None), key=lambda r: r["step"])
    if len(evals) > 1:
        parts.append(f"held-out accuracy {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f}")
    elif evals:  # "0.382 -> 0.382" read as no learning when only the step-0 eval ran (eval.at_end=false)
        parts.append(f"held-out accuracy {evals[0]['eval/accuracy']:.3f} (one evaluation, at step {evals[0]['step']})")
    # Where the wall clock went on a line of its own, then one line, the run's last (README): steps, reward, held-out
    # accuracy and the run dir.
    clock = f"{describe(summary['wall_clock'])}\n" if summary.get("wall_clock") else ""
    return clock + "; ".join([*parts, f"run dir: {run_dir} (summary: python -m grpo.report {run_dir})"])


# The metrics keys without a `<group>/` prefix (every other key has one: reward/mean, grpo/kl, eval/accuracy, ...).
PLAIN_METRIC_KEYS = ("loss", "grad_norm", "lr", "step", "batch", "epoch")
# summary.json's figures, which are not metrics keys; the default objective (null) is the first.
SUMMARY_FIGURES = ("last10_reward_mean", "first10_reward_mean", "best_reward")


def check_objective(key: str | None, eval_enabled: bool, eval_metrics: Sequence[str] = ()) -> None:
    """Start-up check of `train.objective`: an `eval/` key needs the evaluator on and must be one it logs, and a key
    without a `<group>/` prefix must be one of the few plain ones (a typo, or summary.json's last10_reward_mean,
    would otherwise surface only after the whole run, when the objective is read)."""
    if key is not None and "/" not in key and key not in PLAIN_METRIC_KEYS:
        hint = (f"{key} is a figure of summary.json, not a metrics key; the default train.objective=null is "
                "last10_reward_mean" if key in SUMMARY_FIGURES else
                f"metrics keys are {', '.join(PLAIN_METRIC_KEYS)} or <group>/<name> (reward/mean, eval/accuracy, ...)")
        raise ConfigError(f"train.objective={key} is not a metrics key: {hint}")
    if key is None or not key.startswith("eval/"):
        return
    if not eval_enabled:
        raise ConfigError(f"train.objective={key} is an eval metric but eval is off; set eval.enabled=true "
                          "(and eval.task for data=atropos) or train.objective=null")
    if eval_metrics and key not in eval_metrics:
        close = difflib.get_close_matches(key, eval_metrics, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"train.objective={key} is not a metric the evaluator logs; {hint}(it logs "
                          f"{', '.join(eval_metrics)})")


def objective_value(run_dir: Path, key: str | None, final_reward: float | None) -> float | None:
    """What train.py returns: the last-10 mean reward when `key` is None, else the last logged value of `key`."""
    if key is None:
        return final_reward
    rows = read_metrics(run_dir / "metrics.jsonl")
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        logged = sorted({k for r in rows for k in r})
        close = difflib.get_close_matches(key, logged, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"train.objective={key}: no row of {run_dir / 'metrics.jsonl'} has this key (the run "
                          f"itself completed){hint}")
    return float(values[-1])


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


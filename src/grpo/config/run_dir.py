"""Checks of the run dir and of `train.resume` before a run writes anything: the dir is writable with room for
checkpoints and holds no other run, a sweep's dir no earlier jobs, and a resume names a run dir with a complete,
undamaged checkpoint and steps left. `validate` runs the run-dir checks of a job, `grpo.run_records.RunDirGuard` all of them
before Hydra writes `.hydra/` into the dir. Under torchrun, `check_ranks_see_run_files` checks that every rank sees
the run dir and the model dir rank 0 uses (a run across nodes needs them on a shared filesystem)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig

from grpo.config_values import ConfigError
from grpo.trainer import fsdp
from grpo.trainer.checkpoint import COMPLETE, CheckpointManager, checkpoint_problems, read_trainer_state

# Below this much free space in the run dir, a full checkpoint of even a small model may not fit.
MIN_FREE_BYTES = 200 * 1024**2


def check_run_dir(run_dir: Path, key: str = "hydra.run.dir") -> None:
    """The run dir (`key` sets it) must be writable with room for checkpoints; checked before training starts."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # A name of this process's own: two trainers starting in one dir at once unlinked each other's shared probe,
        # and the loser was told the dir "is not writable" instead of "in use" (the run dir's lock, taken next).
        probe = run_dir / f".write_probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run dir {run_dir} is not writable ({type(e).__name__}: {e}); set {key} to a "
                          "writable path") from None
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise ConfigError(
            f"run dir {run_dir} has only {free / 1024**2:.0f} MiB free (need at least "
            f"{MIN_FREE_BYTES / 1024**2:.0f} MiB for checkpoints); free space or set {key} elsewhere"
        )


def held_run(run_dir: Path) -> tuple[str, Path | None]:
    """What of an earlier run `run_dir` holds ("metrics.jsonl with rows, checkpoints up to step_000010", or ""), and
    its latest complete checkpoint (None when it has none)."""
    metrics = run_dir / "metrics.jsonl"
    has_rows = metrics.exists() and metrics.stat().st_size > 0
    latest = CheckpointManager(run_dir).latest()
    held = ", ".join(x for x in (f"{metrics.name} with rows" if has_rows else "",
                                 f"checkpoints up to {latest.name}" if latest is not None else "") if x)
    return held, latest


def check_sweep_dir_unused(sweep_dir: Path) -> None:
    """A sweep must not start in a dir whose jobs already ran (an explicit `hydra.sweep.dir` given twice): Hydra
    writes each job's `.hydra/` over the earlier job's record before any check inside the job can skip it."""
    if not sweep_dir.is_dir():
        return
    candidates = {p.parent for p in sweep_dir.rglob("metrics.jsonl")}
    candidates |= {p.parent for p in sweep_dir.rglob("checkpoints") if p.is_dir()}
    held = sorted(str(d.relative_to(sweep_dir)) for d in candidates if held_run(d)[0])
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ConfigError(
            f"sweep dir {sweep_dir} already holds runs (jobs {shown}), which this sweep's jobs would overwrite; "
            "pick another hydra.sweep.dir, or leave it out for a new dir under multirun/"
        )


def resumed_from(run_dir: Path) -> Path | None:
    """The run dir whose checkpoint `run_dir`'s run was resumed from into `run_dir` (provenance.json's
    `resumed_from`, written by grpo.run_records.record_provenance); None for a fresh run or one resumed in place."""
    try:
        given = json.loads((run_dir / "provenance.json").read_text()).get("resumed_from")
    except (OSError, ValueError, AttributeError):
        return None
    if given is None or Path(given).resolve() == run_dir.resolve():
        return None
    return Path(given)


def check_run_dir_unused(cfg: DictConfig, run_dir: Path) -> None:
    """A fresh run must not start in a run dir that holds another run's metrics or checkpoints: it would truncate
    that run's metrics.jsonl and replace its checkpoints. Continuing that run (`train.resume=<that dir>`) is fine,
    and so is resuming again from the run it was resumed from while it has no checkpoint of its own (a resume into
    another dir stopped before its first checkpoint: its rows past that checkpoint are trained again)."""
    resume = cfg.train.resume
    if resume is not None and Path(resume).resolve() == run_dir.resolve():
        return
    held, latest = held_run(run_dir)
    if not held:
        return
    origin = resumed_from(run_dir)
    if latest is None and resume is not None and origin is not None and origin.resolve() == Path(resume).resolve():
        return
    # Without a checkpoint there is nothing to continue: train.resume would refuse it in turn.
    go_on = (f"continue that run with train.resume={run_dir}, or " if latest is not None
             else "it has no checkpoint to continue from; ")
    raise ConfigError(
        f"run dir {run_dir} already holds a run ({held}), which this run would overwrite; {go_on}start a new one in "
        "another dir (hydra.run.dir=..., or leave it out for a new dir under outputs/)"
    )


def check_resume_exists(cfg: DictConfig) -> None:
    """`train.resume` names an existing path. Run by `grpo.run_records.RunDirGuard` before Hydra creates the run dir: a
    resume's default run dir is train.resume, so a mistyped or pruned path was created (.hydra/, train.log) and then
    refused as having 'no complete checkpoint'. A checkpoint that no longer exists (train.keep_checkpoints prunes
    older ones) gets its run dir named."""
    resume = cfg.train.resume
    if resume is None or Path(resume).exists():
        return
    path = Path(resume)
    if path.parent.name == "checkpoints" and path.parent.parent.is_dir():
        raise ConfigError(f"train.resume={resume} does not exist (a run keeps only its last train.keep_checkpoints "
                          f"checkpoints); train.resume takes the run dir, and the run goes on from its latest "
                          f"complete checkpoint: train.resume={path.parent.parent}")
    raise ConfigError(f"train.resume={resume} does not exist; give the run dir of the run to continue (its last "
                      "line says 'run dir: ...')")


def check_resume_has_steps_left(cfg: DictConfig) -> None:
    """`train.resume` is a run dir with a complete checkpoint (else `raise_for_resume_dir`). Resuming a run whose latest
    checkpoint already holds `train.steps` steps would start the server and train nothing: say so, with the setting
    that continues it."""
    if cfg.train.resume is None:
        return
    checkpoints = CheckpointManager(Path(cfg.train.resume), keep=cfg.train.keep_checkpoints)
    latest = checkpoints.latest()
    if latest is None:
        raise_for_resume_dir(Path(cfg.train.resume))
    problems = checkpoint_problems(latest)
    if problems:
        raise_for_damaged_checkpoint(cfg.train.resume, latest, problems, checkpoints.checkpoints()[:-1])
    done = int(read_trainer_state(latest).get("step", 0))
    if done >= cfg.train.steps:
        raise ConfigError(
            f"train.resume={cfg.train.resume}: its latest checkpoint ({latest.name}) is at step {done}, and "
            f"train.steps={cfg.train.steps}, so there is nothing left to train; to go on, raise train.steps "
            f"(e.g. train.steps={done + cfg.train.steps}; it counts from the run's start)"
        )


def raise_for_damaged_checkpoint(resume: str, latest: Path, problems: list[str], earlier: list[Path]) -> NoReturn:
    """Raises for a latest checkpoint with files missing or cut short: before, vLLM failed its start-up on it (a
    pydantic 'Unterminated string' for a cut-short model.safetensors) or the load a traceback. Not resumed from an
    earlier checkpoint silently: the message says how to (move the damaged one aside)."""
    if earlier:
        fix = (f"move it aside (mv {latest} {latest}.damaged) to resume from {earlier[-1].name}, the checkpoint "
               "before it")
    else:
        fix = "no earlier checkpoint is left, so start the run again without train.resume"
    raise ConfigError(f"train.resume={resume}: its latest checkpoint {latest} is damaged ({'; '.join(problems)}); "
                      f"{fix}")


def raise_for_resume_dir(resume: Path) -> NoReturn:
    """Raises for a `train.resume` without a complete checkpoint under its checkpoints/, saying what to give instead:
    its run dir when it is a checkpoint or the checkpoints/ dir itself (a natural guess that failed in the run with
    a FileNotFoundError traceback)."""
    run_dir = None
    if (resume / COMPLETE).exists() or (resume / "trainer_state.json").exists():
        run_dir = resume.parent.parent
    elif resume.name == "checkpoints":
        run_dir = resume.parent
    if run_dir is not None:
        raise ConfigError(f"train.resume={resume} is inside a run's checkpoints/; train.resume takes the run dir, "
                          f"and the run goes on from its latest complete checkpoint: train.resume={run_dir}")
    origin = resumed_from(resume)
    reachable = CheckpointManager(origin).latest() if origin is not None else None
    if reachable is not None:
        raise ConfigError(f"train.resume={resume} has no complete checkpoint of its own yet: it was resumed from "
                          f"{origin}, whose latest is {reachable}; continue from there into the same dir with "
                          f"train.resume={origin} hydra.run.dir={resume}")
    raise ConfigError(f"train.resume={resume} has no complete checkpoint under checkpoints/ (one is written every "
                      "train.checkpoint_every steps, and a run stopped before the first cannot be resumed); start it "
                      "again without train.resume, or name a run dir that has one")


# The file rank 0 writes into the run dir for `check_ranks_see_run_files` (removed once every rank has looked).
SHARED_PROBE = ".shared_filesystem_probe"


def check_ranks_see_run_files(run_dir: Path, model_dir: str) -> None:
    """Under torchrun (every rank calls it): each rank must see rank 0's run dir, since a resume reads its checkpoints
    on every rank, and rank 0's model dir when it is a local one (an offline preset rank 0 built). Rank 0 writes a
    random token into the run dir; a rank that reads another (a node-local directory of the same name) or none is on
    another filesystem. ConfigError on every rank naming each host that does not see them."""
    if fsdp.world_size() <= 1:
        return
    probe = run_dir / SHARED_PROBE
    shown = None
    if fsdp.is_rank0():
        shown = {"run_dir": str(run_dir), "token": uuid.uuid4().hex, "model_dir": model_dir,
                 "model_dir_is_local": Path(model_dir).is_dir()}
        probe.write_text(shown["token"])
    try:
        shown = fsdp.broadcast_object(shown)
        problems = fsdp.gather_object(shared_files_problem(**shown))  # returns once every rank has looked
    finally:
        if fsdp.is_rank0():
            probe.unlink(missing_ok=True)
    problems = fsdp.broadcast_object([p for p in problems or [] if p])
    if problems:
        raise ConfigError(
            "; ".join(problems) + ". A run across nodes needs its run dir (hydra.run.dir, train.resume) and a local "
            "model dir on a filesystem every node mounts (docs/multi_node.md)")


def shared_files_problem(run_dir: str, token: str, model_dir: str, model_dir_is_local: bool) -> str | None:
    """What this process does not see of rank 0's run files (None when it sees them all)."""
    missing = []
    try:
        seen = (Path(run_dir) / SHARED_PROBE).read_text()
    except OSError:
        seen = None
    if seen != token:
        missing.append(f"run dir {run_dir}")
    if model_dir_is_local and not Path(model_dir).is_dir():
        missing.append(f"model dir {model_dir}")
    if not missing:
        return None
    return f"rank {fsdp.rank()} on host {socket.gethostname()} does not see rank 0's {' or '.join(missing)}"

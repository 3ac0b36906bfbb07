"""Train a language model with GRPO against a vLLM server: the `grpo-train` command (and `python train.py`).

    grpo-train                                        # the default job: warm-started tiny model, arithmetic, CPU vLLM
    grpo-train '~experiment'                          # the bare config: random tiny model, digits task
    grpo-train mode=lora_only model=qwen3b server=gpu
    grpo-train experiment=qwen3b_lora_restart
    grpo-train -m loss.clip_eps=0.1,0.2 optimizer.lr=1e-4,1e-3
    grpo-train --config-dir ./my_conf experiment=my_task  # your own configs beside the shipped ones (conf/)

A job reads top to bottom: compose (Hydra), validate (grpo.config), build (grpo.build), fit (the trainer), clean up;
how a job that does not complete ends is grpo.job's. See docs/architecture.md.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from grpo.build import build_parts, build_trainer
from grpo.conf import CONFIG_DIR
from grpo.config import ConfigError, register_configs, validate
from grpo.config.command_line import check_command_line, module_dirs, rank_hydra_args
from grpo.job import Job, config_error, interrupt_on_sigterm
from grpo.run_records import check_resume_identity
from grpo.trainer.metrics import plot_curves
from grpo.trainer.wall_clock import WallClock

# When the trainer's imports (torch among them) were done: summary.json's `startup_at.imported_seconds`.
IMPORTED_AT = time.time()
register_configs()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """One job. Returns `train.objective` (default: the mean reward of the last 10 rollout batches), which sweeps
    optimise."""
    job = Job.current()
    try:
        validate(cfg, job.own_run_dir)  # everything checkable before a model loads
        check_resume_identity(cfg)  # before the job's provenance.json replaces a resumed run's own record
    except ConfigError as e:
        return job.config_error(e)
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    job.start(cfg)
    job.clock.mark("imported", at=IMPORTED_AT)
    try:
        final = job.completed(fit(cfg, job.run_dir, job.reuses_server(cfg), job.clock))
    except BaseException as e:
        return job.failed(e, cfg)
    finally:
        job.release_device_memory()  # also between the jobs of a sweep
    return job.objective(cfg, final)


def fit(cfg: DictConfig, run_dir: Path, reuse_server: bool = False, clock: WallClock | None = None) -> list[float]:
    """Build every component from the config, train, and tear everything down; the rollout batches' mean rewards.
    `reuse_server`: a sweep's job that takes the server of the job before and keeps its own for the next. `clock`:
    where the job's wall clock goes (start-up, the loop's parts)."""
    parts = build_parts(cfg, run_dir, reuse_server, clock)
    try:
        rewards = build_trainer(parts).fit()
        if cfg.logging.plot and parts.rank0:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", title=str(run_dir.name))
    except BaseException as e:
        parts.close(failed=e)  # the run's own error stays the one reported; teardown errors after it are secondary
        raise
    parts.close(completed=True)
    return rewards


def run() -> None:
    """The command line's entry (`grpo-train`, `python train.py`): the arguments checked before Hydra composes
    (grpo.config.command_line: a typo'd option, a missing plugin or config dir), then the Hydra app."""
    # A console script's sys.path starts at its bin dir; put the working directory first so that `_target_:
    # my_rewards.fn` finds your own modules there, as `python train.py` finds them beside train.py.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        check_command_line(sys.argv[1:], CONFIG_DIR)
    except ConfigError as e:
        config_error(e, multirun=False)
    # The folder holding each --config-dir too: your modules beside your conf/ (`_target_: my_rewards.fn`) import
    # from any working directory.
    for folder in module_dirs(sys.argv[1:]):
        if folder not in sys.path:
            sys.path.insert(1, folder)
    sys.argv += rank_hydra_args()
    main()


if __name__ == "__main__":
    run()

"""One Hydra job of the trainer: where it writes (rank 0 owns the run dir), what it records when it starts and ends,
and how it ends when it does not complete: a config mistake's one line, Ctrl-C's stop block, a server that did not
start, a sweep's failed job logged and skipped; anything else keeps its traceback."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode

from grpo.config_values import ConfigError, option
from grpo.inference.process import ServerStartError
from grpo.pipeline.base import DataSourceError
from grpo.run_records import (
    device_memory,
    discard_unstarted_run_dir,
    record_device_memory,
    record_provenance,
    release_device_memory,
)
from grpo.run_summary import RunSummary, done_message, objective_value
from grpo.schema import ServerConfig
from grpo.serving import kept
from grpo.stop import exit_code, last_step, report_stop
from grpo.trainer.metrics import MetricsFileError
from grpo.trainer.wall_clock import WallClock

log = logging.getLogger(__name__)


def interrupt_on_sigterm(signum: int, frame: Any) -> NoReturn:  # noqa: ARG001
    """SIGTERM takes the same clean path as Ctrl-C: stop the server, keep the last complete checkpoint."""
    raise KeyboardInterrupt(f"signal {signum}")


def config_error(error: BaseException, multirun: bool, run_dir: Path | None = None) -> float:
    """A config mistake (ConfigError) or a data source that does not answer (DataSourceError) is the user's to fix:
    print its message, not a traceback, and exit 1; in a sweep, skip the job (NaN objective, status `skipped` in its
    summary.json for grpo.report) and go on."""
    if multirun:
        log.error("%s: %s (this job is skipped; the sweep goes on)", type(error).__name__, error)
        if run_dir is not None:
            RunSummary(run_dir).skip(error)
        return float("nan")
    if run_dir is not None:
        discard_unstarted_run_dir(run_dir)  # created for a run that never started
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    raise SystemExit(1) from None


def has_trained(run_dir: Path) -> bool:
    """metrics.jsonl has a row of a trained step (not only the step-0 eval); False when it cannot be read."""
    try:
        return bool(last_step(run_dir))
    except MetricsFileError:  # said by the stop report; here it must not replace the error being handled
        return False


class StopKeptServer(Callback):
    """Hydra callback: at the end of a multirun, stop the vLLM server its last job kept (grpo.serving.kept; the
    process's exit would too, through atexit)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:  # noqa: ARG002
        kept.stop_kept()


@dataclass
class Job:
    """The running Hydra job: its run dir, whether it is one of a sweep's, whether this process owns the run dir."""

    run_dir: Path
    multirun: bool
    rank0: bool  # torchrun: rank 0 owns the run dir and every output
    summary: RunSummary | None = None
    memory_before: dict[str, float] | None = None
    # Where the job's wall clock goes (from the process's start for its first job); summary.json's wall_clock.
    clock: WallClock | None = None

    @classmethod
    def current(cls) -> Job:
        hydra = HydraConfig.get()
        return cls(run_dir=Path(hydra.runtime.output_dir), multirun=hydra.mode == RunMode.MULTIRUN,
                   rank0=int(os.environ.get("RANK", "0")) == 0)

    @property
    def own_run_dir(self) -> Path | None:
        """The run dir when this process writes into it (rank 0), else None."""
        return self.run_dir if self.rank0 else None

    def config_error(self, error: BaseException) -> float:
        return config_error(error, self.multirun, self.own_run_dir)

    def reuses_server(self, cfg: Any) -> bool:
        """Whether this job takes the vLLM server the sweep's job before kept, and keeps its own for the next
        (server.reuse_across_jobs): only the jobs of a multirun run by one process (not torchrun's ranks)."""
        return (self.multirun and bool(option(cfg.server, "reuse_across_jobs", ServerConfig.reuse_across_jobs))
                and int(os.environ.get("WORLD_SIZE", "1")) == 1)

    def start(self, cfg: Any) -> None:
        """provenance.json and the summary.json to come (rank 0); one process training on a GPU notes its device
        memory, checked against the end (device_memory.json)."""
        self.clock = WallClock()
        if not self.rank0:
            return
        record_provenance(self.run_dir, cfg)
        self.summary = RunSummary(self.run_dir, Path(cfg.train.resume) if cfg.train.resume is not None else None)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 and cfg.train.device != "cpu":
            self.memory_before = device_memory()

    def completed(self, rewards: list[float]) -> float | None:
        """summary.json of a completed run and its closing line; the mean reward of the last rollout batches."""
        if self.summary is None:
            return None
        final = self.summary.finish(rewards, self.clock)
        log.info(done_message(self.run_dir))
        return final

    def failed(self, error: BaseException, cfg: Any) -> float:
        """How a job that raised ends: NaN for a sweep's job that the sweep goes on from, else SystemExit or `error`
        raised again."""
        # A data source that stops answering after steps were trained (run-api killed mid-run) is the run's failure,
        # not a config problem: a sweep records that job as failed, not skipped.
        config_problem = isinstance(error, ConfigError) or (
            isinstance(error, DataSourceError) and not (self.rank0 and has_trained(self.run_dir)))
        # A config problem is no failed run: a sweep's job is skipped, a single run's dir removed (config_error);
        # a summary.json of `failed` would also replace the one of a run resumed in place.
        if self.summary is not None and not config_problem:
            self.summary.fail(error, self.clock)
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C / SIGTERM: a short block (grpo.stop), not a traceback
            if self.rank0:
                report_stop(error, cfg, self.run_dir, HydraConfig.get().overrides.task)
            raise SystemExit(exit_code(error)) from None
        if config_problem:  # found while building a component (held-out prompts, a data source that does not answer)
            return self.config_error(error)
        if not self.multirun and isinstance(error, ServerStartError):
            # Its message names the cause and the log (whose tail is logged); a traceback of the launch adds 40 frames.
            print(f"{type(error).__name__}: {error}", file=sys.stderr)
            raise SystemExit(1) from None
        if self.multirun:  # a failed sweep job is logged and the sweep goes on with the next one
            log.exception("job failed; continuing the sweep", exc_info=error)
            return float("nan")  # sweepers (Optuna) record a NaN objective as a failed trial
        # The run's own error, named in train.log too (the traceback goes to the console): errors of the teardown
        # after it are logged as secondary (RunParts.close), never in its place.
        log.error("run failed: %s: %s", type(error).__name__, error)
        raise error

    def release_device_memory(self) -> None:
        """Release what the job kept on the device (its exception's frames are gone here), so a multirun's next job
        starts from the device memory this one started from; device_memory.json compares the two."""
        release_device_memory()
        if self.memory_before is not None:
            record_device_memory(self.run_dir, self.memory_before)

    def objective(self, cfg: Any, final_reward: float | None) -> float | None:
        """What the job returns to Hydra (sweeps optimise it): `train.objective` of the completed run."""
        if self.summary is None:
            return None
        try:  # the run completed (summary.json says so) whatever the objective's fate
            return objective_value(self.run_dir, cfg.train.objective, final_reward)
        except ConfigError as e:
            return config_error(e, self.multirun)

"""The contract every data pipeline (conf/data/) implements, and what it learns from the run at setup."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from hydra.utils import get_class

from grpo.algorithms.overlong import TruncationRule
from grpo.config_values import CheckContext
from grpo.pipeline.batching import WarnOnce, prepare_batch
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.group import Group
from grpo.pipeline.source_checks import check_source_config
from grpo.trainer.train_batch import BatchSource, PreparedBatch


@dataclass(frozen=True)
class BatchShape:
    """How the batcher turns a step's groups into micro-batches (from the `train` and `model` config)."""

    micro_batch_size: int
    max_seq_len: int
    pad_token_id: int
    # Token ids at or past it are rejected (they would index past the embedding rows); None = unchecked.
    vocab_size: Optional[int] = None
    # group | batch | none: how rewards become advantages when the source sends none.
    advantage_norm: str = "group"
    # Truncated completions: masked out of the loss, soft overlong penalty (the loss keys; grpo.algorithms.overlong).
    truncation: TruncationRule = TruncationRule()


@dataclass
class PipelineContext:
    """What a pipeline learns from the trainer at setup."""

    tokenizer: Any
    # How the pipeline samples the current policy (grpo.pipeline.generation): the run's server through its gate, the
    # endpoint read anew for every call (a restart may move the server and a sync advances the version).
    generation: GenerationHandle
    # Sequences per optimizer step (micro_batch_size x grad_accum).
    batch_size: int
    max_seq_len: int
    run_dir: Path
    # Rollout batches of the run, and the first one this session fetches (the `step` of next_groups; run-api's
    # step). With train.ppo_epochs x train.mini_batches > 1 an optimizer step is a fraction of one.
    total_steps: int
    start_step: int
    checkpoint_every: int
    seed: int
    # How groups become micro-batches; None = the pipeline only yields groups (next_batch is unavailable).
    batch_shape: Optional[BatchShape] = None
    # train.max_staleness, for a source that generates on its own (`asynchronous_source`, e.g. Atropos): groups
    # more than this many weight versions older than the trainer's are dropped; 0 = no limit. Local pipelines
    # ignore it (their producer, AsyncRollouts, enforces the bound).
    max_staleness: int = 0


class DataSourceError(RuntimeError):
    """The data source cannot be reached or refuses this run; the message says what to start or change (train.py
    prints it without a traceback)."""


class DataPipeline(BatchSource):
    """Produces the groups of each optimizer step (see grpo.pipeline.group) and batches them for the trainer."""

    ctx: Optional[PipelineContext] = None
    # True when the groups are generated outside the trainer's loop, ahead of it (Atropos environments): such a
    # source applies `ctx.max_staleness` itself and is never wrapped in AsyncRollouts.
    asynchronous_source: ClassVar[bool] = False
    # True when `rollout_batch` may run in several threads at once (AsyncRollouts' `rollout_batches_in_flight`).
    concurrent_batches: ClassVar[bool] = False
    # What its groups report for loss.mask_truncated and loss.overlong_buffer (grpo.algorithms.overlong): which
    # sequences hit the token limit (`Group.truncated`), and the single completion limit (`Group.max_new_tokens`).
    reports_truncation: ClassVar[bool] = False
    reports_completion_limit: ClassVar[bool] = False
    # True when the trainer may run it ahead of the loop in a producer thread (train.max_staleness >= 1: AsyncRollouts
    # in grpo.pipeline.rollout_queue): the groups of a step depend on the step, not on the loop's state.
    supports_async_rollouts: ClassVar[bool] = False
    # The evaluator (`_target_`) that plays its own episodes when eval.task names none (AgentPipeline's
    # AgentEvaluator, given the data's grpo.pipeline.eval_settings.AGENT_EVAL_KEYS); None = eval.task's prompts.
    episode_evaluator: ClassVar[Optional[str]] = None

    @classmethod
    def check_config(cls, cfg: Any, ctx: CheckContext) -> None:
        """Checks of the run's config that concern this source (`cfg.data` and the bounds it must fit), before
        anything is built (grpo.config.validate): a ConfigError saying what to set. These, every source's, read the
        capabilities the class declares (grpo.pipeline.source_checks); a source adds its own and calls them."""
        check_source_config(cls, cfg, ctx)

    @classmethod
    def sequences_per_step(cls, data_cfg: Any) -> Optional[int]:
        """The sequences each step trains, all that it generates, as its config `data_cfg` sets them; None when no
        config says (a source that generates on its own)."""
        return None

    def preflight(self) -> None:
        """Checks that need neither the model nor the inference server, run before either starts: a remote source
        that does not answer fails in seconds, not after the server's start-up (DataSourceError)."""

    def start_workers(self) -> None:
        """Start what needs neither the model nor the server (reward-grading worker processes), while the server
        starts: the run calls it before it waits for vLLM; `setup` starts what this did not."""

    @abstractmethod
    def setup(self, ctx: PipelineContext) -> None:
        """Connect to the data source; called once before the first step."""

    @abstractmethod
    def next_groups(self, step: int) -> list[Group]:
        """Groups for optimizer step `step`, at least `batch_size` sequences in all."""

    def rollout_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """next_groups(step) and that call's metrics, for a producer thread (AsyncRollouts). This default reads them
        from `self`, so only one thread may call it at a time unless a subclass overrides it (`concurrent_batches`)."""
        groups = self.next_groups(step)
        return groups, self.metrics()

    def next_batch(self, step: int) -> PreparedBatch:
        """The step's groups as micro-batches shaped by `ctx.batch_shape`."""
        return self.prepare(self.next_groups(step))

    def prepare(self, groups: list[Group]) -> PreparedBatch:
        """`groups` as micro-batches shaped by `ctx.batch_shape` (advantages, padding, checks)."""
        shape = self.ctx.batch_shape if self.ctx is not None else None
        if shape is None:
            raise RuntimeError(f"{type(self).__name__}.setup() got no batch_shape; it can only yield groups")
        if self.data_warnings is None:
            self.data_warnings = WarnOnce()
        return prepare_batch(
            groups, advantage_norm=shape.advantage_norm, max_seq_len=shape.max_seq_len,
            micro_batch_size=shape.micro_batch_size, pad_token_id=shape.pad_token_id, vocab_size=shape.vocab_size,
            warn=self.data_warnings, truncation=shape.truncation,
        )

    # Each kind of degenerate data is warned about once per pipeline (so once per job of a multirun).
    data_warnings: Optional[WarnOnce] = None

    # Last step served and that call's metrics (merged into the step's metrics row by the trainer).
    step: int | None = None
    last_metrics: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        """Metrics of the last next_groups call."""
        return dict(self.last_metrics)

    def state_dict(self) -> dict:
        """Position in the data stream, saved in checkpoints: the last step served."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position saved by state_dict(). Both built-in pipelines resume from the step alone: local
        prompts are a pure function of (seed, step) and run-api keeps its own queue."""
        self.step = state.get("step")


def data_class(data_cfg: Any) -> Any:
    """The class a data config node names (`_target_`), or None: no such node, or its module does not import (an
    optional source's package missing: building the source says what to install)."""
    target = data_cfg.get("_target_") if hasattr(data_cfg, "get") else None
    try:
        return get_class(str(target)) if target else None
    except Exception:
        return None

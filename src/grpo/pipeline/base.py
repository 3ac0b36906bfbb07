"""The contract every data pipeline (conf/data/) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class PipelineContext:
    """What a pipeline learns from the trainer at setup."""

    tokenizer: Any
    # The sync strategy: base_url, served_model and version of the inference server.
    sync: Any
    # Sequences per optimizer step (micro_batch_size x grad_accum).
    batch_size: int
    max_seq_len: int
    run_dir: Path
    total_steps: int
    start_step: int
    checkpoint_every: int
    seed: int


class DataPipeline(ABC):
    """Produces Atropos-shaped groups (see docs/architecture.md), one list per optimizer step."""

    @abstractmethod
    def setup(self, ctx: PipelineContext) -> None:
        """Connect to the data source; called once before the first step."""

    @abstractmethod
    def next_groups(self, step: int) -> list[dict]:
        """Groups for optimizer step `step`, at least `batch_size` sequences in all."""

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

    def close(self) -> None:
        """Release connections and processes. Safe to call twice."""

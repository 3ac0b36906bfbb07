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

    def state_dict(self) -> dict:
        """Position in the data stream, saved in checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position saved by state_dict()."""

    def close(self) -> None:
        """Release connections and processes. Safe to call twice."""

"""What the trainer consumes: training micro-batches, and the source it pulls one optimizer step's batch from.

The data pipelines (grpo.pipeline) build these from groups; the trainer never sees the wire format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Label of a position that carries no loss (prompt tokens, padding): the one ignore label of the project, as in
# Hugging Face's loss functions and Atropos' `masks`.
IGNORE_INDEX = -100


@dataclass
class TrainBatch:
    """One micro-batch, already shifted for a causal LM: ``labels[:, t]`` is the token after ``input_ids[:, t]``.

    All tensors are ``[B, T]`` except ``advantages`` (``[B]`` or ``[B, T]``), ``temperatures`` and ``scores``
    (``[B]``). ``inference_logprobs`` is NaN where the server sent none (the loss treats those as on-policy);
    ``ref_logprobs`` is None when no sequence of the micro-batch carries reference log-probs, else NaN where missing.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    advantages: torch.Tensor
    temperatures: torch.Tensor
    scores: torch.Tensor
    # The trainer's own log-probs at the start of the rollout batch's first update (loss.old_logprobs=recompute);
    # None = the PPO ratio is taken against the rollout log-probs.
    old_logprobs: Optional[torch.Tensor] = None

    @property
    def num_sequences(self) -> int:
        """Sequences (rows) in this micro-batch."""
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Completion tokens that carry loss in this micro-batch."""
        return int(self.loss_mask.sum().item())

    def to(self, device: Any) -> "TrainBatch":
        """A copy with every tensor on ``device``."""
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TrainBatch(**kw)


@dataclass
class PreparedBatch:
    """The micro-batches of one optimizer step and what happened to the data on the way."""

    micro_batches: list[TrainBatch]
    metrics: dict[str, float] = field(default_factory=dict)
    # Global normalisers for gradient accumulation (passed to the loss as total_tokens / total_sequences).
    num_loss_tokens: int = 0
    num_sequences: int = 0
    # Longest completion (loss tokens of one sequence) in the whole step: the default Dr. GRPO divisor.
    max_completion_tokens: int = 0

    @property
    def micro_batch_size(self) -> int:
        """Rows of the largest micro-batch."""
        return max((mb.num_sequences for mb in self.micro_batches), default=0)


class BatchSource(ABC):
    """Where the trainer gets each optimizer step's batch (grpo.pipeline.base.DataPipeline implements it)."""

    @abstractmethod
    def next_batch(self, step: int) -> PreparedBatch:
        """The micro-batches of optimizer step `step` (0-based: the step about to run)."""

    def metrics(self) -> dict[str, float]:
        """Metrics of the last next_batch call (merged into the step's metrics row)."""
        return {}

    def state_dict(self) -> dict:
        """Position in the data stream, saved in checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position saved by state_dict()."""

    def close(self) -> None:
        """Release connections and processes. Safe to call twice."""

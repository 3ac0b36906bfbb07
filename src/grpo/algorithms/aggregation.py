"""Loss aggregations: per-token losses of a micro-batch → one number (``loss.aggregation`` names one).

Each is ``fn(per_token, mask, totals) -> scalar`` with ``per_token`` and ``mask`` ``[B, T]`` (``per_token`` already 0
outside the mask). ``totals`` holds the whole optimizer step's normalisers, so that the micro-batch losses of one
step add up to the loss of the full batch (gradient accumulation); a None total means this micro-batch's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo.algorithms.registry import Registry


@dataclass(frozen=True)
class Totals:
    """Normalisers of one optimizer step; None = the micro-batch's own."""

    # Loss tokens of the step (token_mean).
    tokens: Optional[float] = None
    # Sequences of the step (the seq_mean_* aggregations).
    sequences: Optional[float] = None
    # Divisor of seq_mean_token_sum_norm (a constant, or the step's longest completion).
    max_tokens: Optional[float] = None


Aggregation = Callable[[torch.Tensor, torch.Tensor, Totals], torch.Tensor]
AGGREGATIONS: Registry[Aggregation] = Registry("aggregation")


def _mean_over_sequences(per_seq: torch.Tensor, totals: Totals) -> torch.Tensor:
    seqs = float(totals.sequences) if totals.sequences is not None else float(per_seq.shape[0])
    return per_seq.sum() / max(seqs, 1.0)


@AGGREGATIONS.register("token_mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Sum over tokens / loss tokens of the step: every token weighs the same (DAPO)."""
    denom = float(totals.tokens) if totals.tokens is not None else float(mask.sum())
    return per_token.sum() / max(denom, 1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Mean over a sequence's tokens, then over the step's sequences (the GRPO paper's)."""
    return _mean_over_sequences(per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1), totals)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Dr. GRPO: a sequence's token sum / a constant length (``totals.max_tokens``, else this micro-batch's longest
    completion), then the mean over the step's sequences: no length bias."""
    if totals.max_tokens is not None:
        norm = float(totals.max_tokens)
    else:
        seq_tokens = mask.sum(dim=1)
        norm = float(seq_tokens.max()) if seq_tokens.numel() else 1.0
    return _mean_over_sequences(per_token.sum(dim=1) / max(norm, 1.0), totals)

"""Advantage estimators: one group's scores → one advantage per sample (``train.advantage_norm`` names one).

Each is ``fn(scores, batch_scores) -> advantages``: ``scores`` is the group's ``[G]`` float64 rewards,
``batch_scores`` every reward of the optimizer step's batch ``[N]`` (for estimators that normalise across groups);
the result is ``[G]``. Register your own with ``@ADVANTAGE_ESTIMATORS.register("name")`` before the config schema is
imported (docs/algorithms.md, "An estimator of your own"), or pass the function itself to
``prepare_batch(advantage_norm=...)``.

The advantage stage (`step_advantages`): one optimizer step's groups (`GroupRewards`: scores, the advantages their
data source sent, its zero overrides) → one advantage per sequence. The batcher (`grpo.pipeline.batching`) calls it
once per step, after the scores are final (reward shaping) and before any sequence is dropped, so every baseline sees
every sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from grpo.algorithms.registry import Registry

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")

# One sequence's advantage: one number, or one per token (unshifted) when its data source sent them so.
Advantage = Union[float, list[float]]


@dataclass(frozen=True)
class GroupRewards:
    """One group as the advantage stage reads it, one entry per sequence: its score (shaped, final), the advantage
    its data source sent (None: estimate it from the scores) and whether the source asked for 0 (Atropos'
    ``set_advantage_to_zero``)."""

    scores: Sequence[float]
    sent: Sequence[Optional[Advantage]]
    zeroed: Sequence[bool]


def group_advantages(group: GroupRewards, estimator: AdvantageEstimator, batch_scores: torch.Tensor
                     ) -> list[Advantage]:
    """One group's advantages: those its source sent kept, the rest from the group's scores by `estimator` (called
    only when one is missing); a zeroed sequence gets 0, per token if its advantage was per token."""
    advantages: list[Optional[Advantage]] = list(group.sent)
    if any(a is None for a in advantages):
        scores = torch.tensor(list(group.scores), dtype=torch.float64)
        estimated = estimator(scores, batch_scores).tolist()
        advantages = [e if a is None else a for a, e in zip(advantages, estimated)]
    return [([0.0] * len(a) if isinstance(a, list) else 0.0) if zero else a
            for a, zero in zip(advantages, group.zeroed)]


def step_advantages(groups: Sequence[GroupRewards], estimator: AdvantageEstimator) -> list[list[Advantage]]:
    """The advantage stage of one optimizer step: each group's advantages (`group_advantages`), with every score of
    the step as the estimator's ``batch_scores``."""
    batch_scores = torch.tensor([s for g in groups for s in g.scores], dtype=torch.float64)
    return [group_advantages(g, estimator, batch_scores) for g in groups]

# Added to a standard deviation before dividing by it: a group whose rewards all agree gets advantage 0, not 0/0.
STD_EPS = 1e-6


def _population_std(scores: torch.Tensor) -> torch.Tensor:
    return scores.std(unbiased=False)


@ADVANTAGE_ESTIMATORS.register("group")
def group_normalized(scores: torch.Tensor, batch_scores: torch.Tensor) -> torch.Tensor:
    """GRPO: (r - group mean) / (population std of the group + 1e-6)."""
    return (scores - scores.mean()) / (_population_std(scores) + STD_EPS)


@ADVANTAGE_ESTIMATORS.register("batch")
def batch_normalized(scores: torch.Tensor, batch_scores: torch.Tensor) -> torch.Tensor:
    """(r - group mean) / (population std of every reward of the batch + 1e-6)."""
    return (scores - scores.mean()) / (_population_std(batch_scores) + STD_EPS)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
@ADVANTAGE_ESTIMATORS.register("none")
def group_centered(scores: torch.Tensor, batch_scores: torch.Tensor) -> torch.Tensor:
    """r - group mean, unscaled: Dr. GRPO's advantage (``dr_grpo``; ``none`` is its older name)."""
    return scores - scores.mean()


@ADVANTAGE_ESTIMATORS.register("rloo")
def leave_one_out(scores: torch.Tensor, batch_scores: torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): r_i - the mean of the group's other rewards, so a sample's own
    reward never enters its baseline. Equal to G / (G - 1) x (r_i - group mean); 0 for a group of one (no other
    sample to compare with)."""
    n = scores.numel()
    if n < 2:
        return torch.zeros_like(scores)
    others_mean = (scores.sum() - scores) / (n - 1)
    return scores - others_mean

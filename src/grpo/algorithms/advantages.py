"""Advantage estimators: one group's scores → one advantage per sample (``train.advantage_norm`` names one).

Each is ``fn(scores, batch_scores) -> advantages``: ``scores`` is the group's ``[G]`` float64 rewards,
``batch_scores`` every reward of the optimizer step's batch ``[N]`` (for estimators that normalise across groups);
the result is ``[G]``. The batcher (`grpo.pipeline.batching`) calls the estimator for each group whose data source sent
no advantages. Register your own with ``@ADVANTAGE_ESTIMATORS.register("name")`` before the config schema is imported
(docs/algorithms.md, "An estimator of your own"), or pass the function itself to ``prepare_batch(advantage_norm=...)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo.algorithms.registry import Registry

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")

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

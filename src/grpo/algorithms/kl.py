"""Per-token estimators of KL(pi || ref) (``loss.kl_estimator`` names one), after Schulman's "Approximating KL
Divergence": each maps ``x = log ref - log pi`` at the sampled token to an estimate whose mean over samples from pi
is the KL."""

from __future__ import annotations

from enum import StrEnum
from typing import Callable

import torch

from grpo.algorithms.registry import Registry

KLEstimator = Callable[[torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


class KLReference(StrEnum):
    """What a KL penalty measures the policy against (``loss.kl_reference``): the run's initial weights, kept frozen
    (GRPO's pi_ref), or the log-probs the rollouts carry (an environment's reference log-probs where it sends them,
    else the sampler's: close to the policy itself, so the penalty only holds each update near its rollouts)."""

    initial = "initial"
    rollout = "rollout"


@KL_ESTIMATORS.register("k1")
def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """-x: unbiased, negative at some tokens."""
    return -log_ratio


@KL_ESTIMATORS.register("k2")
def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """x^2 / 2: biased, low variance, non-negative."""
    return 0.5 * log_ratio * log_ratio


@KL_ESTIMATORS.register("k3")
def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(x) - 1 - x: unbiased and non-negative."""
    return torch.expm1(log_ratio) - log_ratio

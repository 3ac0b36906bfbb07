"""Policy-gradient objectives per token: the importance ratio against pi_old made into a surrogate to maximise.

Each registered objective is ``fn(log_ratio, advantages, mask, clip) -> PolicyObjective`` on ``[B, T]`` tensors:
``log_ratio = log pi - log pi_old`` (with grad through log pi), ``advantages`` per token, ``mask`` 1 at loss tokens
(for objectives that pool a sequence's tokens). `grpo.trainer.loss.GRPOLoss` uses ``ppo_clip``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, NamedTuple, Optional

import torch

from grpo.algorithms.registry import Registry

# exp() of a log-ratio beyond this overflows float32 gradients in the unclipped branch; beyond it the ratio is
# saturated (gradient 0), which only happens for tokens far outside any trust region.
MAX_LOG_RATIO = 20.0


class OldLogprobs(StrEnum):
    """The pi_old of the ratio (``loss.old_logprobs``): vLLM's rollout log-probs, or the trainer's own before the
    rollout batch's first update."""

    rollout = "rollout"
    recompute = "recompute"


@dataclass(frozen=True)
class ClipRange:
    """The trust region: the ratio is clipped to [1 - low, 1 + high]; ``dual`` (c > 1, or None) bounds the objective
    of a negative advantage below at c * A (Ye et al. 2020)."""

    low: float
    high: float
    dual: Optional[float] = None


class PolicyObjective(NamedTuple):
    """An objective per token, the ratio it clipped (for the clip metrics) and where the dual clip's floor acted."""

    objective: torch.Tensor
    ratio: torch.Tensor
    dual_clipped: torch.Tensor


def ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio), saturated beyond ``MAX_LOG_RATIO``."""
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


PolicyObjectiveFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ClipRange], PolicyObjective]
POLICY_OBJECTIVES: Registry[PolicyObjectiveFn] = Registry("policy objective")


@POLICY_OBJECTIVES.register("ppo_clip")
def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: ClipRange) -> PolicyObjective:
    """PPO's pessimistic objective per token, min(r A, clip(r, 1 - low, 1 + high) A) for every sign of A, with the
    dual clip's floor max(., c A) where A < 0."""
    r = ratio(log_ratio)
    obj = torch.minimum(r * advantages, r.clamp(1.0 - clip.low, 1.0 + clip.high) * advantages)
    dual_clipped = torch.zeros_like(advantages, dtype=torch.bool)
    if clip.dual is not None:
        floor = clip.dual * advantages
        dual_clipped = (advantages < 0) & (obj < floor)
        obj = torch.where(advantages < 0, torch.maximum(obj, floor), obj)
    return PolicyObjective(obj, r, dual_clipped)

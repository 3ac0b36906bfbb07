"""Policy-gradient objectives per token: the importance ratio against pi_old made into a surrogate to maximise.

Each registered objective is ``fn(log_ratio, advantages, mask, clip) -> PolicyObjective`` on ``[B, T]`` tensors:
``log_ratio = log pi - log pi_old`` (with grad through log pi), ``advantages`` per token, ``mask`` 1 at loss tokens
(for objectives that pool a sequence's tokens). `grpo.trainer.loss.GRPOLoss` uses ``ppo_clip``, ``GSPOLoss``
``gspo_clip`` and ``CISPOLoss`` ``cispo``.
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


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: the mean of each sequence's token log-ratios over its loss tokens (0 for a row without one), the log
    of the geometric mean of its token ratios."""
    return (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


@POLICY_OBJECTIVES.register("gspo_clip")
def gspo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: ClipRange) -> PolicyObjective:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clipped objective on the sequence-level
    ratio s_i = exp(mean of sequence i's token log-ratios), the same s_i at each of its tokens. The gradient reaches
    every token of the sequence through the mean (each gets 1/|y_i| of it), and is 0 for the whole sequence where
    the clip binds. The clip range is that of a geometric mean: far narrower than a token ratio's (the paper:
    3e-4 / 4e-4)."""
    seq = sequence_log_ratio(log_ratio, mask)
    return ppo_clip(seq[:, None].expand_as(log_ratio), advantages, mask, clip)


@POLICY_OBJECTIVES.register("cispo")
def cispo(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: ClipRange) -> PolicyObjective:
    """CISPO (MiniMax-M1, 2025): the importance weight clip(r, 1 - low, 1 + high) detached, times A times the log-prob
    of every token. No token's gradient is dropped (the weight bounds it instead): the gradient at each token is
    w A grad(log pi). The log-prob enters as ``log_ratio`` (log pi - log pi_old, pi_old a constant), which has the
    same gradient and a value of 0 on-policy. No dual clip (nothing to floor: the weight is already bounded)."""
    r = ratio(log_ratio)
    weight = r.clamp(1.0 - clip.low, 1.0 + clip.high).detach()
    return PolicyObjective(weight * advantages * log_ratio, r, torch.zeros_like(advantages, dtype=torch.bool))

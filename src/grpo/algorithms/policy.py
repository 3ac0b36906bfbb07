"""Policy-gradient objectives per token: the importance ratio against pi_old made into a surrogate to maximise.

``loss.objective`` names one (`grpo.trainer.loss.GRPOLoss` runs it): ``ppo_clip`` (GRPO/PPO, the default), ``gspo``
(the sequence-level ratio) or ``cispo`` (the clipped, detached importance weight). Each is a small function
``fn(log_ratio, advantages, mask, clip) -> Surrogate`` on ``[B, T]`` tensors: ``log_ratio = log pi - log pi_old``
(with grad through log pi), ``advantages`` per token, ``mask`` 1 at loss tokens (for objectives that pool a sequence's
tokens), registered with ``@policy_objective("name")``, which also declares what the loss must know of it (whether it
pools a sequence's tokens, whether it takes a dual clip). A function registered before the config schema is imported
becomes a choice of ``loss.objective`` (docs/algorithms.md, "An objective of your own").
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


class Surrogate(NamedTuple):
    """An objective per token, the ratio it clipped, where the dual clip's floor acted, and the tokens where its clip
    bound below and above (the clip metrics; all ``[B, T]``)."""

    objective: torch.Tensor
    ratio: torch.Tensor
    dual_clipped: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


def ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio), saturated beyond ``MAX_LOG_RATIO``."""
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


SurrogateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ClipRange], Surrogate]


@dataclass(frozen=True)
class PolicyObjective:
    """A registered objective: its function and what the loss must know of it.

    Args:
        fn: ``fn(log_ratio, advantages, mask, clip) -> Surrogate``.
        pools_sequences: the gradient at a token depends on the log-probs of the other tokens of its sequence
            (GSPO's sequence ratio): the loss is then not token-separable (the fused log-prob path takes two passes).
        takes_dual_clip: ``loss.dual_clip`` applies (False: refused when the loss is built).
    """

    fn: SurrogateFn
    pools_sequences: bool = False
    takes_dual_clip: bool = True

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 clip: ClipRange) -> Surrogate:
        return self.fn(log_ratio, advantages, mask, clip)


POLICY_OBJECTIVES: Registry[PolicyObjective] = Registry("policy objective")


def policy_objective(name: str, *, pools_sequences: bool = False,
                     takes_dual_clip: bool = True) -> Callable[[SurrogateFn], SurrogateFn]:
    """Decorator registering ``fn`` as the objective ``name`` (``loss.objective=name``) with what it declares
    (``PolicyObjective``); returns ``fn`` unchanged."""

    def add(fn: SurrogateFn) -> SurrogateFn:
        POLICY_OBJECTIVES.register(name)(PolicyObjective(fn, pools_sequences, takes_dual_clip))
        return fn

    return add


@policy_objective("ppo_clip")
def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: ClipRange) -> Surrogate:
    """PPO's pessimistic objective per token, min(r A, clip(r, 1 - low, 1 + high) A) for every sign of A, with the
    dual clip's floor max(., c A) where A < 0. The clip binds (takes the gradient away) only on the side the advantage
    pushes the ratio towards."""
    r = ratio(log_ratio)
    obj = torch.minimum(r * advantages, r.clamp(1.0 - clip.low, 1.0 + clip.high) * advantages)
    dual_clipped = torch.zeros_like(advantages, dtype=torch.bool)
    if clip.dual is not None:
        floor = clip.dual * advantages
        dual_clipped = (advantages < 0) & (obj < floor)
        obj = torch.where(advantages < 0, torch.maximum(obj, floor), obj)
    low = (advantages < 0) & (r < 1.0 - clip.low)
    high = (advantages > 0) & (r > 1.0 + clip.high)
    return Surrogate(obj, r, dual_clipped, low, high)


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: the mean of each sequence's token log-ratios over its loss tokens (0 for a row without one), the log
    of the geometric mean of its token ratios."""
    return (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


@policy_objective("gspo", pools_sequences=True)
def gspo(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: ClipRange) -> Surrogate:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clipped objective on the sequence-level
    ratio s_i = exp(mean of sequence i's token log-ratios), the same s_i at each of its tokens. The gradient reaches
    every token of the sequence through the mean (each gets 1/|y_i| of it), and is 0 for the whole sequence where
    the clip binds. The clip range is that of a geometric mean: far narrower than a token ratio's (the paper:
    3e-4 / 4e-4; conf/loss/gspo.yaml)."""
    seq = sequence_log_ratio(log_ratio, mask)
    return ppo_clip(seq[:, None].expand_as(log_ratio), advantages, mask, clip)


@policy_objective("cispo", takes_dual_clip=False)
def cispo(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: ClipRange) -> Surrogate:
    """CISPO (MiniMax-M1, 2025): the importance weight clip(r, 1 - low, 1 + high) detached, times A times the log-prob
    of every token. No token's gradient is dropped (the weight bounds it instead): the gradient at each token is
    w A grad(log pi). The log-prob enters as ``log_ratio`` (log pi - log pi_old, pi_old a constant), which has the
    same gradient and a value of 0 on-policy. No dual clip (the weight is clipped and detached, so no objective is
    left to floor); the clip metrics count the tokens whose weight was clipped, for either sign of A."""
    r = ratio(log_ratio)
    weight = r.clamp(1.0 - clip.low, 1.0 + clip.high).detach()
    none = torch.zeros_like(advantages, dtype=torch.bool)
    return Surrogate(weight * advantages * log_ratio, r, none, r < 1.0 - clip.low, r > 1.0 + clip.high)

"""Schema of the loss group (conf/loss/grpo.yaml describes each key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from grpo.algorithms.aggregation import AGGREGATIONS
from grpo.algorithms.kl import KL_ESTIMATORS, KLReference
from grpo.algorithms.policy import POLICY_OBJECTIVES, OldLogprobs

# The choice sets are the registries' names (grpo.algorithms): each written once, where the code that acts on it
# lives.
KLEstimator = KL_ESTIMATORS.choices(
    "KLEstimator", __name__, "Estimator of KL(pi || ref) per token (grpo.algorithms.kl).")
Objective = POLICY_OBJECTIVES.choices(
    "Objective", __name__, "The policy-gradient objective (grpo.algorithms.policy).")
Aggregation = AGGREGATIONS.choices(
    "Aggregation", __name__, "How per-token losses become one number (grpo.algorithms.aggregation).")


@dataclass
class LossConfig:
    """The policy-gradient loss; see grpo.trainer.loss.GRPOLoss. Each key is described in conf/loss/grpo.yaml, the base
    of the other loss options."""

    _target_: str = "grpo.trainer.loss.GRPOLoss"
    objective: Objective = Objective.ppo_clip
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_reference: KLReference = KLReference.initial
    entropy_coef: float = 0.0
    entropy_target: Optional[float] = None
    entropy_coef_delta: float = 0.005
    entropy_coef_max: float = 0.5
    aggregation: Aggregation = Aggregation.token_mean
    max_tokens_norm: Optional[int] = None
    old_logprobs: OldLogprobs = OldLogprobs.rollout
    # [low, high] or null. Typed Any, not Optional[List[float]]: a typed list left null is a ListConfig that code
    # walking the config cannot iterate; GRPOLoss checks the band (two numbers, low < 1 < high).
    token_mask: Any = None
    sequence_mask: Any = None
    # Truncated completions (stopped at the token limit, no EOS) add no loss, gradient or normaliser count.
    mask_truncated: bool = False
    # DAPO's soft overlong penalty: tokens before the limit over which it grows from 0; null disables it.
    overlong_buffer: Optional[int] = None
    # The penalty at the limit, subtracted from the reward.
    overlong_penalty_factor: float = 1.0


__all__ = ["Aggregation", "KLEstimator", "KLReference", "LossConfig", "Objective", "OldLogprobs"]

"""Schema of the loss group: each key described above its field."""

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
    """The policy-gradient loss; see grpo.trainer.loss.GRPOLoss. conf/loss/grpo.yaml is this schema as it is; the other
    loss options build on it and hold what differs."""

    _target_: str = "grpo.trainer.loss.GRPOLoss"
    # Policy-gradient objective (grpo.algorithms.policy): ppo_clip (token-level PPO clip), gspo (the clipped
    # sequence-level ratio, loss=gspo), cispo (the clipped, detached importance weight, loss=cispo), or a function of
    # your own registered with @policy_objective("name").
    objective: Objective = Objective.ppo_clip
    # Lower clip range: the ratio is clipped at 1 - clip_eps.
    clip_eps: float = 0.2
    # Upper clip range (DAPO clip-higher); null = clip_eps.
    clip_eps_high: Optional[float] = None
    # Dual-clip constant c > 1 bounding the loss for A < 0 at c*|A|; null disables.
    dual_clip: Optional[float] = None
    # Truncated importance weighting: cap on the trainer/rollout ratio weight; null disables.
    tis_cap: Optional[float] = None
    # KL penalty coefficient (GRPO's beta, TRL's beta, verl's kl_loss_coef); 0 disables it.
    kl_coef: float = 0.0
    # KL estimator: k1, k2 or k3 (Schulman's unbiased, non-negative).
    kl_estimator: KLEstimator = KLEstimator.k3
    # What the penalty measures against: initial (the run's initial weights, frozen: GRPO's reference policy; a second
    # copy of the weights on the trainer's device, or the LoRA base with the adapter off, and one forward per rollout
    # batch) or rollout (the log-probs the rollouts carry: an environment's reference log-probs where it sends them,
    # else vLLM's sampler log-probs). Only read when kl_coef > 0.
    kl_reference: KLReference = KLReference.initial
    # Entropy bonus coefficient: the loss subtracts entropy_coef x the policy's per-token entropy (at the sampling
    # temperature, with its gradient), aggregated as the rest; counters the entropy collapse that grpo/entropy shows. 0
    # disables it. Above 0 every loss token counts, so it needs train.skip_zero_advantage=false.
    entropy_coef: float = 0.0
    # Target entropy (nats per token) the bonus's coefficient is steered towards; null keeps entropy_coef constant. Set,
    # entropy_coef is the starting coefficient: after each optimizer step it rises by entropy_coef_delta while the
    # step's grpo/entropy is below the target and falls by it otherwise, within [0, entropy_coef_max] (grpo/entropy_coef
    # logs it; a checkpoint keeps it). A constant bonus large enough to matter can make the entropy run away
    # (bench/README.md).
    entropy_target: Optional[float] = None
    # The coefficient's change per optimizer step under entropy_target.
    entropy_coef_delta: float = 0.005
    # The coefficient's ceiling under entropy_target.
    entropy_coef_max: float = 0.5
    # Aggregation: token_mean (over the global batch), seq_mean_token_mean, or seq_mean_token_sum_norm (Dr. GRPO).
    aggregation: Aggregation = Aggregation.token_mean
    # Constant divisor of seq_mean_token_sum_norm; null = the longest completion in the batch.
    max_tokens_norm: Optional[int] = None
    # pi_old of the PPO ratio: rollout (vLLM's sampler log-probs) or recompute (the trainer's own log-probs before the
    # rollout batch's first update; with tis_cap the rollout log-probs then give the truncated off-policy correction).
    old_logprobs: OldLogprobs = OldLogprobs.rollout
    # Off-policy token mask: [low, high] (e.g. [0.5, 2.0]); a token whose trainer/sampler probability ratio leaves the
    # band gets no loss and no gradient (IcePop-style; bf16 kernel mismatch between vLLM and the trainer); null
    # disables.
    token_mask: Any = None
    # Off-policy sequence mask: [low, high]; a sequence whose geometric-mean trainer/sampler ratio leaves the band gets
    # no loss and no gradient; null disables. Both masks leave the normalisers unchanged; mismatch/* metrics every step.
    # Both typed Any, not Optional[List[float]]: a typed list left null is a ListConfig that code walking the config
    # cannot iterate; GRPOLoss checks the band (two numbers, low < 1 < high).
    sequence_mask: Any = None
    # Completions cut by the length limit (finish reason 'length', no EOS): true leaves them out of the loss (TRL's
    # mask_truncated_completions). Their rewards still join their group's baseline; they add no loss, no gradient and
    # nothing to the normalisers (data/masked_truncated counts them). Needs rollouts that report truncation (local
    # data).
    mask_truncated: bool = False
    # DAPO's soft overlong penalty (verl's overlong_buffer.len): the reward gets a penalty growing linearly from 0 to
    # -overlong_penalty_factor over the last overlong_buffer tokens before the completion limit (data.max_new_tokens),
    # before advantages (reward/overlong_penalty logs its mean). null disables it. Needs single-turn local rollouts.
    overlong_buffer: Optional[int] = None
    # The penalty at the limit (verl's overlong_buffer.penalty_factor).
    overlong_penalty_factor: float = 1.0


__all__ = ["Aggregation", "KLEstimator", "KLReference", "LossConfig", "Objective", "OldLogprobs"]

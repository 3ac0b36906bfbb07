"""The GRPO policy-gradient loss: a registered policy objective against pi_old, and the terms around it.

Per completion token t of sequence i, with trainer log-prob ``logp``, rollout (inference server) log-prob ``q``
and advantage ``A``, for the default objective (``loss.objective=ppo_clip``):

    r   = exp(logp - q)                       # q := logp.detach() where the server sent none (NaN): on-policy
    obj = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)      # for EVERY sign of A (PPO)
    obj = max(obj, dual_clip * A)  where A < 0                     # optional dual clip (Ye et al. 2020)
    loss_t = -obj + kl_coef * KL_t - entropy_coef * H_t             # H_t: the policy's entropy at token t

The loss is then aggregated over tokens (see ``GRPOLoss``). ``loss.objective`` picks the objective by name (``gspo``,
``cispo``, or a function of your own registered with ``grpo.algorithms.policy.policy_objective``); the KL estimators
and the aggregations are registered functions of `grpo.algorithms` too. The KL penalty, the entropy bonus and the
off-policy corrections (pi_old, truncated importance sampling, the masks) are the terms of `grpo.trainer.loss_terms`;
this class puts them together and reports the metrics.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional, Sequence

import torch

from grpo.algorithms.aggregation import AGGREGATIONS, Totals
from grpo.algorithms.overlong import TruncationRule
from grpo.algorithms.policy import POLICY_OBJECTIVES, ClipRange, Surrogate
from grpo.config_values import CheckContext
from grpo.schema.loss import LossConfig
from grpo.trainer.loss_checks import check_loss_config
from grpo.trainer.loss_interface import LossInputs, LossNeeds, PolicyLoss
from grpo.trainer.loss_terms import EntropyBonus, KLPenalty, OffPolicyCorrection, Ratios


class GRPOLoss(PolicyLoss):
    """The policy-gradient loss of every ``conf/loss/*.yaml``: a registered policy objective with optional dual clip,
    truncated importance sampling, off-policy masks, KL penalty and entropy bonus (a ``PolicyLoss``).

    Args:
        objective: the registered policy objective (``grpo.algorithms.policy.POLICY_OBJECTIVES``): ``ppo_clip``
            (token-level PPO clip, GRPO's), ``gspo`` (the clipped sequence-level ratio; conf/loss/gspo.yaml sets its
            clip range and aggregation) or ``cispo`` (the clipped, detached importance weight; refuses
            ``dual_clip``; conf/loss/cispo.yaml), or one of your own (``@policy_objective("name")``).
        clip_eps: lower clip range; the ratio is clipped below at ``1 - clip_eps``.
        clip_eps_high: upper clip range (DAPO clip-higher); None = ``clip_eps``.
        dual_clip: constant c > 1; for A < 0 the objective is bounded below by ``c * A`` (Ye et al. 2020,
            "Mastering Complex Control in MOBA Games with Deep RL"). None disables.
        tis_cap: truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
            Off-Policy RL Training"). The PPO ratio is then taken against the trainer's own detached log-probs
            (the proximal policy, decoupled PPO as in Hilton et al. 2021), and each token's objective is weighted
            by ``w = min(exp(logp.detach() - q), tis_cap)``, the truncated trainer/rollout ratio. With one optimizer
            step per batch the proximal ratio is exactly 1 in value, so the gradient is ``w * A * grad(logp)``.
            None disables (the PPO ratio is taken directly against the rollout log-probs).
        kl_coef: weight of the per-token KL penalty against ``ref_logprobs``. 0 disables the penalty (``grpo/kl`` is
            still reported, against the reference log-probs where given, else the rollout's).
        kl_estimator: Schulman's estimators of KL(pi || ref) with ``x = ref - logp``: ``k1 = -x``,
            ``k2 = x^2 / 2``, ``k3 = exp(x) - 1 - x``.
        kl_reference: what ``ref_logprobs`` are. ``initial``: the run's initial policy, frozen (GRPO's pi_ref;
            ``needs.reference_policy``: the trainer computes them for every token, and a call without them while
            the penalty is on raises). ``rollout``: whatever the rollouts carry (an environment's reference
            log-probs, NaN where missing, or None), the rollout log-probs filling the gaps.
        entropy_coef: weight of the entropy bonus: ``-entropy_coef * H_t`` per loss token, ``H_t`` the entropy of the
            policy's distribution at token t (at the sampling temperature, with gradient; passed as ``entropy``),
            aggregated as the rest of the loss (verl's ``entropy_coeff``, OpenRLHF's ``entropy_loss_coef``). It
            pushes against the entropy collapse of GRPO training. 0 disables it (unless ``entropy_target`` is set:
            then it is the starting coefficient).
        entropy_target: None, or the entropy (nats per token) the coefficient is steered towards: after each
            optimizer step ``adapt`` moves it by ``entropy_coef_delta``, up while the step's entropy is below the
            target and down otherwise, within ``[0, entropy_coef_max]`` (``grpo.algorithms.entropy_control``).
        entropy_coef_delta, entropy_coef_max: that step and that ceiling.
        aggregation: ``token_mean`` (sum over tokens / total tokens of the global batch), ``seq_mean_token_mean``
            (mean over a sequence's tokens, then over the global batch's sequences) or ``seq_mean_token_sum_norm``
            (Dr. GRPO: a sequence's token sum / ``max_tokens_norm`` (or the longest completion), then mean over
            sequences).
        max_tokens_norm: constant divisor of ``seq_mean_token_sum_norm``; None = the longest completion.
        token_mask: ``[low, high]`` with low < 1 < high, or None: a token whose trainer/sampler ratio (below) leaves
            the band gets no loss and no gradient (IcePop-style masking of tokens where vLLM's numerics and the
            trainer's disagree); the normalisers still count it.
        sequence_mask: ``[low, high]``, or None: a sequence whose geometric-mean trainer/sampler ratio (exp of the
            mean token log-ratio) leaves the band gets no loss and no gradient at any token.
            The trainer side of both ratios is pi_old: the recomputed log-probs with ``old_logprobs="recompute"``,
            else the current ones (which also move with the updates of a batch: use ``recompute`` with several
            updates per batch). A row without sampler log-probs is never masked.
        old_logprobs: the pi_old of the PPO ratio. ``rollout``: the rollout (vLLM) log-probs, as above.
            ``recompute``: the trainer's own log-probs at the start of the rollout batch's first update (one extra
            forward without grad; verl's recompute_log_prob), passed as ``old_logprobs``: the ratio is
            ``pi / pi_old`` (exactly 1 at the first update, so only the policy's own movement is clipped) and, with
            ``tis_cap``, each token is weighted by the truncated off-policy correction ``min(pi_old / mu, tis_cap)``
            against vLLM's sampler ``mu``. Several updates per batch (``train.ppo_epochs``, ``train.mini_batches``)
            are where the two differ; with ``rollout`` and ``tis_cap`` the ratio is the proximal one (1 in value,
            so the clip never binds), hence use ``recompute`` with ``tis_cap``.
        mask_truncated, overlong_buffer, overlong_penalty_factor: what happens to completions cut by the token
            limit (``grpo.algorithms.overlong.TruncationRule``, checked and held as ``truncation``). They act on
            the rollouts, not here: the batcher leaves masked rows out and adds the penalty to the rewards before
            advantages (``grpo.build`` hands it the rule from the loss config).
    """

    def __init__(
        self,
        objective: str = "ppo_clip",
        clip_eps: float = LossConfig.clip_eps,
        clip_eps_high: Optional[float] = None,
        dual_clip: Optional[float] = None,
        tis_cap: Optional[float] = None,
        kl_coef: float = LossConfig.kl_coef,
        kl_estimator: str = "k3",
        kl_reference: str = "initial",
        entropy_coef: float = LossConfig.entropy_coef,
        entropy_target: Optional[float] = None,
        entropy_coef_delta: float = LossConfig.entropy_coef_delta,
        entropy_coef_max: float = LossConfig.entropy_coef_max,
        aggregation: str = "token_mean",
        max_tokens_norm: Optional[int] = None,
        old_logprobs: str = "rollout",
        token_mask: Optional[Sequence[float]] = None,
        sequence_mask: Optional[Sequence[float]] = None,
        mask_truncated: bool = LossConfig.mask_truncated,
        overlong_buffer: Optional[int] = None,
        overlong_penalty_factor: float = LossConfig.overlong_penalty_factor,
    ):
        self.objective = objective
        self._objective = POLICY_OBJECTIVES.get(objective, "objective")
        self.clip = _clip_range(clip_eps, clip_eps_high, dual_clip)
        if dual_clip is not None and not self._objective.takes_dual_clip:
            raise ValueError(f"loss.dual_clip does not apply to loss.objective={objective} (it takes no dual clip: "
                             "CISPO's importance weight is clipped and detached, so no objective is left to floor); "
                             "set loss.dual_clip=null")
        self.kl = KLPenalty(kl_coef, kl_estimator, kl_reference)
        self.entropy = EntropyBonus(entropy_coef, entropy_target, entropy_coef_delta, entropy_coef_max)
        self.off_policy = OffPolicyCorrection(old_logprobs, tis_cap, token_mask, sequence_mask)
        self.aggregation = aggregation
        self._aggregate_fn = AGGREGATIONS.get(aggregation, "aggregation")
        if max_tokens_norm is not None and max_tokens_norm <= 0:
            raise ValueError(f"max_tokens_norm must be > 0, got {max_tokens_norm}")
        self.max_tokens_norm = max_tokens_norm
        # Applied by the batcher to the rollouts before advantages (rows left out, rewards shaped), not in __call__.
        self.truncation = TruncationRule(bool(mask_truncated), overlong_buffer, float(overlong_penalty_factor))

    @classmethod
    def check_config(cls, cfg: Any, ctx: CheckContext) -> None:
        """Its settings against the run's (grpo.trainer.loss_checks); each value's own range is checked when built."""
        check_loss_config(cfg, ctx)

    @property
    def needs(self) -> LossNeeds:
        """The reference policy while a KL penalty against the initial weights is on; pi_old recomputed with
        ``old_logprobs="recompute"``; the entropies while the entropy bonus is on or steered. Token-separable unless
        the objective pools a sequence (GSPO) or the sequence mask acts on the current log-probs
        (``old_logprobs="rollout"``). A zero advantage adds nothing unless the KL penalty or the entropy bonus is on
        (every objective is a multiple of the advantage)."""
        return LossNeeds(
            reference_policy=self.kl.needs_reference_policy,
            recomputed_old_logprobs=self.off_policy.recomputes_old,
            entropy=self.entropy.on,
            token_separable=not (self._objective.pools_sequences or self.off_policy.moving_sequence_mask),
            zero_advantage_adds_nothing=self.kl.coef == 0 and not self.entropy.on,
        )

    def adapt(self, step_entropy: float) -> None:
        """After an optimizer step, with ``entropy_target``: the next step's coefficient from this step's mean
        entropy (``grpo/entropy``). Nothing without a target."""
        self.entropy.adapt(step_entropy)

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps of the loss: the coefficient ``adapt`` moves (a resumed run goes on from it)."""
        return {"entropy_coef": self.entropy.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict``'s values (a checkpoint without them leaves the configured ones)."""
        if "entropy_coef" in state:
            self.entropy.coef = float(state["entropy_coef"])

    def __repr__(self) -> str:
        # What train.py logs at start-up: the settings, not an object address; enum members as their plain values.
        op, kl, ent, trunc = self.off_policy, self.kl, self.entropy, self.truncation
        values = {
            "objective": self.objective, "clip_eps": self.clip.low, "clip_eps_high": self.clip.high,
            "dual_clip": self.clip.dual, "tis_cap": op.tis_cap, "kl_coef": kl.coef, "kl_estimator": kl.estimator,
            "kl_reference": kl.reference, "entropy_coef": ent.coef, "entropy_target": ent.target,
            "aggregation": self.aggregation, "max_tokens_norm": self.max_tokens_norm, "old_logprobs": op.old_logprobs,
            "token_mask": op.token_mask, "sequence_mask": op.sequence_mask, "mask_truncated": trunc.mask_truncated,
            "overlong_buffer": trunc.overlong_buffer, "overlong_penalty_factor": trunc.overlong_penalty_factor,
        }
        text = ", ".join(f"{f}={v.value if isinstance(v, Enum) else v!r}" for f, v in values.items())
        return f"{type(self).__name__}({text})"

    def __call__(self, inputs: LossInputs, with_metrics: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch and its metrics (``PolicyLoss.__call__``; the tensors are ``LossInputs``'). The
        Dr. GRPO divisor is ``max_tokens_norm``, else ``inputs.totals.max_tokens`` (default: the longest completion
        of this micro-batch). Returns ``(scalar loss, metrics)`` with python-float metrics averaged over this
        micro-batch's loss tokens."""
        logprobs = inputs.logprobs
        mask = inputs.mask.to(logprobs.dtype)
        valid = mask > 0
        adv = inputs.advantages.to(logprobs.dtype)
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(logprobs)
        r = self.off_policy.ratios(logprobs, inputs.inference_logprobs, valid, inputs.old_logprobs)
        surrogate = self._objective(r.pg_log_ratio, adv, mask, self.clip)
        obj = surrogate.objective
        if r.tis_w is not None:
            obj = obj * r.tis_w
        per_token = -obj
        kl = self.kl(logprobs, self.kl.reference_logprobs(r.rollout, inputs.ref_logprobs, valid))
        if self.kl.coef > 0:
            per_token = per_token + self.kl.coef * kl
        if self.entropy.on:
            per_token = self.entropy(per_token, inputs.entropy)
        # Zero (not NaN) outside the loss mask and at the tokens the off-policy masks drop; the normalisers below
        # keep counting the dropped tokens, so the loss of the rest does not change with how many were dropped.
        per_token = per_token * mask * r.keep
        totals = inputs.totals
        if self.max_tokens_norm is not None:
            totals = Totals(totals.tokens, totals.sequences, self.max_tokens_norm)
        loss = self._aggregate_fn(per_token, mask, totals)
        if not with_metrics:
            return loss, {}
        bonus = {"grpo/entropy_coef": self.entropy.coef} if self.entropy.on else {}  # the coefficient of this step
        return loss, {**self._metrics(logprobs.detach(), r, surrogate, adv, mask, valid, kl),
                      **self.off_policy.metrics(r, mask), **bonus}

    @torch.no_grad()
    def _metrics(
        self, lp_det: torch.Tensor, r: Ratios, surrogate: Surrogate, adv: torch.Tensor, mask: torch.Tensor,
        valid: torch.Tensor, kl: torch.Tensor,
    ) -> dict[str, float]:
        """The clip, ratio, KL and advantage metrics of one micro-batch, averaged over its loss tokens."""
        n = mask.sum().clamp(min=1)
        pr = surrogate.ratio.detach()
        low, high = valid & surrogate.clipped_low, valid & surrogate.clipped_high
        log_r_old = (lp_det - r.old) * mask
        metrics = {
            "grpo/mean_ratio": float((r.ratio * mask).sum() / n),
            # Against pi_old (what the clip sees): how far this update has moved the policy.
            "grpo/ratio_old_mean": float((pr * mask).sum() / n),
            "grpo/ratio_old_max": float(torch.where(valid, pr, torch.zeros_like(pr)).max()) if bool(valid.any()) else 1.0,
            "grpo/approx_kl_old": float((0.5 * log_r_old * log_r_old).sum() / n),
            "grpo/clipped_fraction": float((low | high).sum() / n),
            "grpo/clipped_low": float(low.sum() / n),
            "grpo/clipped_high": float(high.sum() / n),
            "grpo/kl": float((kl.detach() * mask).sum() / n),
            "grpo/logprob_diff": float(((lp_det - r.rollout).abs() * mask).sum() / n),
            "grpo/advantage_mean": float((adv * mask).sum() / n),
            "grpo/tokens": float(mask.sum()),
        }
        if self.clip.dual is not None:
            metrics["grpo/dual_clipped"] = float((surrogate.dual_clipped & valid).sum() / n)
        return {**metrics, **self.off_policy.tis_metrics(r, mask, valid, n)}


def _clip_range(clip_eps: float, clip_eps_high: Optional[float], dual_clip: Optional[float]) -> ClipRange:
    """``loss.clip_eps`` / ``clip_eps_high`` (None: ``clip_eps``) / ``dual_clip`` checked: ValueError naming the key."""
    # clip_eps = 1: no lower bound on the ratio (CISPO's usual setting).
    if not 0 < clip_eps <= 1:
        raise ValueError(f"clip_eps must be in (0, 1], got {clip_eps}")
    if clip_eps_high is not None and clip_eps_high <= 0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    return ClipRange(float(clip_eps), float(clip_eps if clip_eps_high is None else clip_eps_high), dual_clip)

"""The GRPO policy-gradient loss: token-level PPO clipping against the rollout log-probs.

Per completion token t of sequence i, with trainer log-prob ``logp``, rollout (inference server) log-prob ``q``
and advantage ``A``:

    r   = exp(logp - q)                       # q := logp.detach() where the server sent none (NaN): on-policy
    obj = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)      # for EVERY sign of A (PPO)
    obj = max(obj, dual_clip * A)  where A < 0                     # optional dual clip (Ye et al. 2020)
    loss_t = -obj + kl_coef * KL_t

The loss is then aggregated over tokens (see ``GRPOLoss``). With ``tis_cap`` set, the rollout/trainer mismatch is
handled by truncated importance sampling instead of inside the PPO ratio (see ``GRPOLoss``). The clipped objective,
the KL estimators and the aggregations are the registered functions of `grpo.algorithms`; this class chooses pi_old
and the rollout log-probs, applies the TIS weights and reports the metrics.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from grpo.algorithms.aggregation import AGGREGATIONS, Totals
from grpo.algorithms.kl import KL_ESTIMATORS
from grpo.algorithms.policy import MAX_LOG_RATIO, POLICY_OBJECTIVES, ClipRange, OldLogprobs, ratio


class GRPOLoss:
    """Clipped GRPO/PPO loss with optional dual clip, truncated importance sampling and KL penalty.

    Args:
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
        kl_coef: weight of the per-token KL penalty against ``ref_logprobs`` when given, else against the rollout
            log-probs. 0 disables the penalty (``grpo/kl`` is still reported).
        kl_estimator: Schulman's estimators of KL(pi || ref) with ``x = ref - logp``: ``k1 = -x``,
            ``k2 = x^2 / 2``, ``k3 = exp(x) - 1 - x``.
        aggregation: ``token_mean`` (sum over tokens / total tokens of the global batch), ``seq_mean_token_mean``
            (mean over a sequence's tokens, then over the global batch's sequences) or ``seq_mean_token_sum_norm``
            (Dr. GRPO: a sequence's token sum / ``max_tokens_norm`` (or the longest completion), then mean over
            sequences).
        max_tokens_norm: constant divisor of ``seq_mean_token_sum_norm``; None = the longest completion.
        old_logprobs: the pi_old of the PPO ratio. ``rollout``: the rollout (vLLM) log-probs, as above.
            ``recompute``: the trainer's own log-probs at the start of the rollout batch's first update (one extra
            forward without grad; verl's recompute_log_prob), passed as ``old_logprobs``: the ratio is
            ``pi / pi_old`` (exactly 1 at the first update, so only the policy's own movement is clipped) and, with
            ``tis_cap``, each token is weighted by the truncated off-policy correction ``min(pi_old / mu, tis_cap)``
            against vLLM's sampler ``mu``. Several updates per batch (``train.ppo_epochs``, ``train.mini_batches``)
            are where the two differ; with ``rollout`` and ``tis_cap`` the ratio is the proximal one (1 in value,
            so the clip never binds), hence use ``recompute`` with ``tis_cap``.
    """

    # Every term is a function of one token's log-prob and constants (normalisers come from the mask or the
    # arguments), so the gradient at token i depends on logprobs[i] alone. The fused log-prob path relies on it.
    token_separable = True
    # The registered policy objective (grpo.algorithms.policy) the ratio goes through.
    objective = "ppo_clip"

    def __init__(
        self,
        clip_eps: float = 0.2,
        clip_eps_high: Optional[float] = None,
        dual_clip: Optional[float] = None,
        tis_cap: Optional[float] = None,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        aggregation: str = "token_mean",
        max_tokens_norm: Optional[int] = None,
        old_logprobs: str = "rollout",
    ):
        if not 0 < clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
        if clip_eps_high is not None and clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
        if dual_clip is not None and dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        if tis_cap is not None and tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self._kl_fn = KL_ESTIMATORS.get(kl_estimator, "kl_estimator")
        self._aggregate_fn = AGGREGATIONS.get(aggregation, "aggregation")
        if old_logprobs not in OldLogprobs.__members__:
            raise ValueError(f"old_logprobs must be one of {tuple(OldLogprobs.__members__)}, got {old_logprobs!r}")
        if max_tokens_norm is not None and max_tokens_norm <= 0:
            raise ValueError(f"max_tokens_norm must be > 0, got {max_tokens_norm}")
        self.clip_eps = float(clip_eps)
        self.clip_eps_high = float(clip_eps if clip_eps_high is None else clip_eps_high)
        self.dual_clip = dual_clip
        self.tis_cap = tis_cap
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.aggregation = aggregation
        self.max_tokens_norm = max_tokens_norm
        self.old_logprobs = old_logprobs
        self._objective_fn = POLICY_OBJECTIVES.get(self.objective, "objective")

    @property
    def zero_advantage_adds_nothing(self) -> bool:
        """True when a token whose advantage is 0 adds nothing to the loss or its gradient: every clip branch is a
        multiple of the advantage, and only the KL penalty is not. `train.skip_zero_advantage` relies on it."""
        return self.kl_coef == 0

    def __repr__(self) -> str:
        # What train.py logs at start-up: the settings, not an object address.
        fields = ("clip_eps", "clip_eps_high", "dual_clip", "tis_cap", "kl_coef", "kl_estimator", "aggregation",
                  "max_tokens_norm", "old_logprobs")
        values = {f: getattr(self, f) for f in fields}
        # Enum members from the typed config read as their plain values.
        values = {f: getattr(v, "value", v) for f, v in values.items()}
        return f"{type(self).__name__}({', '.join(f'{f}={v!r}' for f, v in values.items())})"

    def kl(self, logprobs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate of the policy from ``ref`` (same shape as ``logprobs``)."""
        return self._kl_fn((ref - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))

    def __call__(
        self,
        logprobs: torch.Tensor,
        inference_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logprobs: Optional[torch.Tensor] = None,
        total_tokens: Optional[float] = None,
        total_sequences: Optional[float] = None,
        max_tokens: Optional[float] = None,
        with_metrics: bool = True,
        old_logprobs: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch and its metrics.

        Args:
            logprobs: ``[B, T]`` trainer log-probs of the labels (with grad).
            inference_logprobs: ``[B, T]`` rollout log-probs; NaN = not sent (treated as on-policy).
            advantages: ``[B]`` or ``[B, T]``.
            mask: ``[B, T]`` 1 at completion tokens that carry loss.
            ref_logprobs: ``[B, T]`` reference log-probs for the KL penalty, NaN where missing; None = use the
                rollout log-probs.
            total_tokens, total_sequences: normalisers of the whole optimizer step for gradient accumulation
                (default: this micro-batch), so summing micro-batch losses equals the full-batch loss.
            max_tokens: Dr. GRPO divisor when ``max_tokens_norm`` is None (default: the longest completion of this
                micro-batch; pass ``PreparedBatch.max_completion_tokens`` to match across micro-batches).
            with_metrics: False skips the metrics (each is a device sync); the fused path's per-chunk calls use it.
            old_logprobs: ``[B, T]`` pi_old recomputed by the trainer (``old_logprobs="recompute"``); None = the
                rollout log-probs are pi_old.
        Returns:
            ``(scalar loss, metrics)`` with python-float metrics averaged over this micro-batch's loss tokens.
        """
        mask = mask.to(logprobs.dtype)
        valid = mask > 0
        adv = advantages.to(logprobs.dtype)
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(logprobs)
        r = self._ratios(logprobs, inference_logprobs, valid, old_logprobs)
        clip = ClipRange(self.clip_eps, self.clip_eps_high, self.dual_clip)
        obj, r["pg_ratio"], dual_active = self._objective_fn(r["pg_log_ratio"], adv, mask, clip)
        if r["tis_w"] is not None:
            obj = obj * r["tis_w"]
        per_token = -obj

        kl_ref = r["rollout"]
        if ref_logprobs is not None:
            ref = ref_logprobs.to(logprobs.dtype)
            kl_ref = torch.where(valid & torch.isfinite(ref), ref, r["rollout"])
        kl = self.kl(logprobs, kl_ref)
        if self.kl_coef > 0:
            per_token = per_token + self.kl_coef * kl

        per_token = per_token * mask  # zero (not NaN) at masked positions
        max_tokens = self.max_tokens_norm if self.max_tokens_norm is not None else max_tokens
        loss = self._aggregate_fn(per_token, mask, Totals(total_tokens, total_sequences, max_tokens))
        if not with_metrics:
            return loss, {}
        return loss, self._metrics(logprobs.detach(), r, adv, mask, valid, kl, dual_active)

    def _ratios(
        self, logprobs: torch.Tensor, inference_logprobs: torch.Tensor, valid: torch.Tensor,
        old_logprobs: Optional[torch.Tensor],
    ) -> dict[str, Any]:
        """The rollout log-probs as used, the ratio to them, pi_old, the log-ratio the clip sees and the TIS
        weights."""
        lp_det = logprobs.detach()
        # Rollout log-probs: missing (NaN), non-finite or outside the loss mask → on-policy. Also keeps the prompt's
        # 1.0 placeholders and padding out of exp(), where an inf would turn 0 * inf into NaN gradients.
        inf = inference_logprobs.to(logprobs.dtype)
        rollout = torch.where(valid & torch.isfinite(inf), inf, lp_det)
        ratio_det = ratio(logprobs - rollout).detach()
        tis_src = tis_w = None
        if old_logprobs is not None:
            old = torch.where(valid, old_logprobs.to(logprobs.dtype), lp_det)
            tis_src = ratio(old - rollout)
        elif self.tis_cap is not None:
            old = lp_det  # proximal ratio: 1 in value, grad of logp
            tis_src = ratio_det
        else:
            old = rollout
        if self.tis_cap is not None:
            tis_w = tis_src.clamp(max=self.tis_cap)
        return {"rollout": rollout, "ratio": ratio_det, "old": old, "pg_log_ratio": logprobs - old, "tis_src": tis_src,
                "tis_w": tis_w}

    @torch.no_grad()
    def _metrics(
        self, lp_det: torch.Tensor, r: dict[str, Any], adv: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor,
        kl: torch.Tensor, dual_active: torch.Tensor,
    ) -> dict[str, float]:
        lo, hi = 1.0 - self.clip_eps, 1.0 + self.clip_eps_high
        n = mask.sum().clamp(min=1)
        pr = r["pg_ratio"].detach()
        low = valid & (adv < 0) & (pr < lo)
        high = valid & (adv > 0) & (pr > hi)
        log_r_old = (lp_det - r["old"]) * mask
        metrics = {
            "grpo/mean_ratio": float((r["ratio"] * mask).sum() / n),
            # Against pi_old (what the clip sees): how far this update has moved the policy.
            "grpo/ratio_old_mean": float((pr * mask).sum() / n),
            "grpo/ratio_old_max": float(torch.where(valid, pr, torch.zeros_like(pr)).max()) if bool(valid.any()) else 1.0,
            "grpo/approx_kl_old": float((0.5 * log_r_old * log_r_old).sum() / n),
            "grpo/clipped_fraction": float((low | high).sum() / n),
            "grpo/clipped_low": float(low.sum() / n),
            "grpo/clipped_high": float(high.sum() / n),
            "grpo/kl": float((kl.detach() * mask).sum() / n),
            "grpo/logprob_diff": float(((lp_det - r["rollout"]).abs() * mask).sum() / n),
            "grpo/advantage_mean": float((adv * mask).sum() / n),
            "grpo/tokens": float(mask.sum()),
        }
        if self.dual_clip is not None:
            metrics["grpo/dual_clipped"] = float((dual_active & valid).sum() / n)
        if r["tis_w"] is not None:
            metrics["grpo/tis_weight"] = float((r["tis_w"] * mask).sum() / n)
            metrics["grpo/tis_capped"] = float((valid & (r["tis_src"] > self.tis_cap)).sum() / n)
        return metrics

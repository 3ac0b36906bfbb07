"""The GRPO policy-gradient loss: token-level PPO clipping against the rollout log-probs.

Per completion token t of sequence i, with trainer log-prob ``logp``, rollout (inference server) log-prob ``q``
and advantage ``A``:

    r   = exp(logp - q)                       # q := logp.detach() where the server sent none (NaN): on-policy
    obj = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)      # for EVERY sign of A (PPO)
    obj = max(obj, dual_clip * A)  where A < 0                     # optional dual clip (Ye et al. 2020)
    loss_t = -obj + kl_coef * KL_t - entropy_coef * H_t             # H_t: the policy's entropy at token t

The loss is then aggregated over tokens (see ``GRPOLoss``). With ``tis_cap`` set, the rollout/trainer mismatch is
handled by truncated importance sampling instead of inside the PPO ratio (see ``GRPOLoss``). The clipped objective,
the KL estimators and the aggregations are the registered functions of `grpo.algorithms`; this class chooses pi_old
and the rollout log-probs, applies the TIS weights and reports the metrics.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from grpo.algorithms.aggregation import AGGREGATIONS, Totals
from grpo.algorithms.entropy_control import adapt_entropy_coef
from grpo.algorithms.kl import KL_ESTIMATORS, KLReference
from grpo.algorithms.overlong import TruncationRule
from grpo.algorithms.policy import (
    MAX_LOG_RATIO,
    POLICY_OBJECTIVES,
    ClipRange,
    OldLogprobs,
    ratio,
    sequence_log_ratio,
)


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
        kl_coef: weight of the per-token KL penalty against ``ref_logprobs``. 0 disables the penalty (``grpo/kl`` is
            still reported, against the reference log-probs where given, else the rollout's).
        kl_estimator: Schulman's estimators of KL(pi || ref) with ``x = ref - logp``: ``k1 = -x``,
            ``k2 = x^2 / 2``, ``k3 = exp(x) - 1 - x``.
        kl_reference: what ``ref_logprobs`` are. ``initial``: the run's initial policy, frozen (GRPO's pi_ref;
            ``needs_reference_policy``: the trainer computes them for every token, and a call without them while
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

    # The registered policy objective (grpo.algorithms.policy) the ratio goes through.
    objective = "ppo_clip"
    # True when the objective pools a sequence's tokens (GSPO's sequence ratio): the gradient at a token then depends
    # on the log-probs of the other tokens of its sequence.
    objective_pools_sequences = False

    def __init__(
        self,
        clip_eps: float = 0.2,
        clip_eps_high: Optional[float] = None,
        dual_clip: Optional[float] = None,
        tis_cap: Optional[float] = None,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_reference: str = "initial",
        entropy_coef: float = 0.0,
        entropy_target: Optional[float] = None,
        entropy_coef_delta: float = 0.005,
        entropy_coef_max: float = 0.5,
        aggregation: str = "token_mean",
        max_tokens_norm: Optional[int] = None,
        old_logprobs: str = "rollout",
        token_mask: Optional[Sequence[float]] = None,
        sequence_mask: Optional[Sequence[float]] = None,
        mask_truncated: bool = False,
        overlong_buffer: Optional[int] = None,
        overlong_penalty_factor: float = 1.0,
    ):
        # clip_eps = 1: no lower bound on the ratio (CISPO's usual setting).
        if not 0 < clip_eps <= 1:
            raise ValueError(f"clip_eps must be in (0, 1], got {clip_eps}")
        if clip_eps_high is not None and clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
        if dual_clip is not None and dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        if tis_cap is not None and tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0 (a bonus; a negative one would punish entropy), got {entropy_coef}")
        if entropy_target is not None and not (entropy_target > 0 and entropy_coef_delta > 0
                                               and entropy_coef_max >= entropy_coef):
            raise ValueError(
                "loss.entropy_target needs a target > 0, entropy_coef_delta > 0 and entropy_coef_max >= entropy_coef "
                f"(got {entropy_target}, {entropy_coef_delta}, {entropy_coef_max} >= {entropy_coef})")
        self._kl_fn = KL_ESTIMATORS.get(kl_estimator, "kl_estimator")
        if kl_reference not in KLReference.__members__:
            raise ValueError(f"kl_reference must be one of {tuple(KLReference.__members__)}, got {kl_reference!r}")
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
        self.kl_reference = kl_reference
        self.entropy_coef = float(entropy_coef)
        self.entropy_target = None if entropy_target is None else float(entropy_target)
        self.entropy_coef_delta = float(entropy_coef_delta)
        self.entropy_coef_max = float(entropy_coef_max)
        self.aggregation = aggregation
        self.max_tokens_norm = max_tokens_norm
        self.old_logprobs = old_logprobs
        self.token_mask = _band(token_mask, "token_mask")
        self.sequence_mask = _band(sequence_mask, "sequence_mask")
        self._objective_fn = POLICY_OBJECTIVES.get(self.objective, "objective")
        # Applied by the batcher to the rollouts before advantages (rows left out, rewards shaped), not in __call__.
        self.truncation = TruncationRule(bool(mask_truncated), overlong_buffer, float(overlong_penalty_factor))

    @property
    def token_separable(self) -> bool:
        """True when the gradient at token i depends on ``logprobs[i]`` alone (every other input is a constant or a
        normaliser), which lets the fused log-prob path take each chunk's gradient before the next chunk's log-probs
        exist; otherwise it takes two passes. False for an objective that pools a sequence (GSPO), and for the
        sequence mask on the current log-probs (``old_logprobs="rollout"``)."""
        moving_sequence_mask = self.sequence_mask is not None and self.old_logprobs != OldLogprobs.recompute
        return not (self.objective_pools_sequences or moving_sequence_mask)

    @property
    def zero_advantage_adds_nothing(self) -> bool:
        """True when a token whose advantage is 0 adds nothing to the loss or its gradient: every clip branch is a
        multiple of the advantage, and only the KL penalty and the entropy bonus are not.
        `train.skip_zero_advantage` relies on it."""
        return self.kl_coef == 0 and not self.uses_entropy

    @property
    def needs_reference_policy(self) -> bool:
        """True when the KL penalty is on and measured against the initial policy: the trainer then keeps that policy
        frozen (grpo.trainer.reference) and passes its log-probs as ``ref_logprobs``."""
        return self.kl_coef > 0 and self.kl_reference == KLReference.initial

    @property
    def uses_entropy(self) -> bool:
        """True when the loss takes the per-token entropies (``entropy=``, with gradient): the entropy bonus is on,
        or steered (``entropy_target``: its coefficient may be 0 now and rise later)."""
        return self.entropy_coef > 0 or self.entropy_target is not None

    def adapt(self, step_entropy: float) -> None:
        """After an optimizer step, with ``entropy_target``: the next step's coefficient from this step's mean
        entropy (``grpo/entropy``). Nothing without a target."""
        if self.entropy_target is not None:
            self.entropy_coef = adapt_entropy_coef(self.entropy_coef, step_entropy, self.entropy_target,
                                                   self.entropy_coef_delta, self.entropy_coef_max)

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps of the loss: the coefficient ``adapt`` moves (a resumed run goes on from it)."""
        return {"entropy_coef": self.entropy_coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict``'s values (a checkpoint without them leaves the configured ones)."""
        if "entropy_coef" in state:
            self.entropy_coef = float(state["entropy_coef"])

    def __repr__(self) -> str:
        # What train.py logs at start-up: the settings, not an object address.
        fields = ("clip_eps", "clip_eps_high", "dual_clip", "tis_cap", "kl_coef", "kl_estimator", "kl_reference",
                  "entropy_coef", "entropy_target", "aggregation", "max_tokens_norm", "old_logprobs", "token_mask",
                  "sequence_mask")
        values = {f: getattr(self, f) for f in fields}
        values.update({f: getattr(self.truncation, f) for f in ("mask_truncated", "overlong_buffer",
                                                                  "overlong_penalty_factor")})
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
        entropy: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch and its metrics.

        Args:
            logprobs: ``[B, T]`` trainer log-probs of the labels (with grad).
            inference_logprobs: ``[B, T]`` rollout log-probs; NaN = not sent (treated as on-policy).
            advantages: ``[B]`` or ``[B, T]``.
            mask: ``[B, T]`` 1 at completion tokens that carry loss.
            ref_logprobs: ``[B, T]`` reference log-probs for the KL penalty: the initial policy's
                (``kl_reference="initial"``: needed while the penalty is on), or an environment's, NaN where missing
                (the rollout log-probs fill the gaps); None = the rollout log-probs.
            total_tokens, total_sequences: normalisers of the whole optimizer step for gradient accumulation
                (default: this micro-batch), so summing micro-batch losses equals the full-batch loss.
            max_tokens: Dr. GRPO divisor when ``max_tokens_norm`` is None (default: the longest completion of this
                micro-batch; pass ``PreparedBatch.max_completion_tokens`` to match across micro-batches).
            with_metrics: False skips the metrics (each is a device sync); the fused path's per-chunk calls use it.
            old_logprobs: ``[B, T]`` pi_old recomputed by the trainer (``old_logprobs="recompute"``); None = the
                rollout log-probs are pi_old.
            entropy: ``[B, T]`` per-token entropies of the policy (with grad) for the entropy bonus; needed when
                ``entropy_coef > 0`` (``uses_entropy``), ignored otherwise.
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

        if ref_logprobs is None and self.needs_reference_policy:
            raise ValueError("loss.kl_reference=initial with loss.kl_coef > 0 needs the initial policy's log-probs "
                             "(ref_logprobs=...); the trainer passes them when it was given a reference policy")
        kl = self.kl(logprobs, self._kl_reference(r["rollout"], ref_logprobs, valid))
        if self.kl_coef > 0:
            per_token = per_token + self.kl_coef * kl
        if self.uses_entropy:
            if entropy is None:
                raise ValueError("an entropy bonus (loss.entropy_coef > 0 or loss.entropy_target) needs the per-token "
                                 "entropies (entropy=...)")
            per_token = per_token - self.entropy_coef * entropy.to(per_token.dtype)

        # Zero (not NaN) outside the loss mask and at the tokens the off-policy masks drop; the normalisers below
        # keep counting the dropped tokens, so the loss of the rest does not change with how many were dropped.
        per_token = per_token * mask * r["keep"]
        max_tokens = self.max_tokens_norm if self.max_tokens_norm is not None else max_tokens
        loss = self._aggregate_fn(per_token, mask, Totals(total_tokens, total_sequences, max_tokens))
        if not with_metrics:
            return loss, {}
        bonus = {"grpo/entropy_coef": self.entropy_coef} if self.uses_entropy else {}  # the coefficient of this step
        return loss, {**self._metrics(logprobs.detach(), r, adv, mask, valid, kl, dual_active),
                      **self._mismatch_metrics(r, mask), **bonus}

    @staticmethod
    def _kl_reference(rollout: torch.Tensor, ref_logprobs: Optional[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
        """The log-probs the KL term measures against: the reference's where given and finite, else the rollout's."""
        if ref_logprobs is None:
            return rollout
        ref = ref_logprobs.to(rollout.dtype)
        return torch.where(valid & torch.isfinite(ref), ref, rollout)

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
        # The trainer/sampler mismatch at tokens with sampler log-probs (0 elsewhere): log pi_old - log mu, pi_old the
        # recomputed log-probs or the current ones.
        sampled = valid & torch.isfinite(inf)
        trainer = old if old_logprobs is not None else lp_det
        mismatch = torch.where(sampled, trainer - rollout, torch.zeros_like(lp_det))
        token_out, seq_out = self._outside_bands(mismatch, sampled)
        keep = (~(token_out | seq_out[:, None])).to(logprobs.dtype)
        return {"rollout": rollout, "ratio": ratio_det, "old": old, "pg_log_ratio": logprobs - old, "tis_src": tis_src,
                "tis_w": tis_w, "sampled": sampled, "mismatch": mismatch, "keep": keep, "seq_out": seq_out}

    def _outside_bands(self, mismatch: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` tokens whose trainer/sampler ratio leaves ``token_mask`` and ``[B]`` sequences whose geometric
        mean ratio leaves ``sequence_mask`` (all False for a band that is off)."""
        token_out = torch.zeros_like(sampled)
        seq_out = torch.zeros(sampled.shape[0], dtype=torch.bool, device=sampled.device)
        if self.token_mask is not None:
            low, high = (math.log(b) for b in self.token_mask)
            token_out = sampled & ((mismatch < low) | (mismatch > high))
        if self.sequence_mask is not None:
            low, high = (math.log(b) for b in self.sequence_mask)
            seq = sequence_log_ratio(mismatch, sampled.to(mismatch.dtype))
            seq_out = sampled.any(dim=1) & ((seq < low) | (seq > high))
        return token_out, seq_out

    @torch.no_grad()
    def _mismatch_metrics(self, r: dict[str, Any], mask: torch.Tensor) -> dict[str, float]:
        """How far the sampler's log-probs are from the trainer's at the sampled tokens (x = log pi_old - log mu):
        ``mismatch/kl`` is KL(mu || pi_old) by Schulman's k3 (exp(x) - 1 - x, samples from mu), ``mismatch/kl_k1``
        the mean of -x; and the share of loss tokens and sequences the off-policy masks dropped. 0 for identical
        log-probs, and when the sampler sent none."""
        x = r["mismatch"]
        sampled = r["sampled"].to(x.dtype)
        n = sampled.sum().clamp(min=1)
        seqs = (mask.sum(dim=1) > 0).sum().clamp(min=1)
        return {
            "mismatch/kl": float(((torch.expm1(x) - x) * sampled).sum() / n),
            "mismatch/kl_k1": float((-x * sampled).sum() / n),
            "mismatch/masked_fraction": float(((1 - r["keep"]) * mask).sum() / mask.sum().clamp(min=1)),
            "mismatch/masked_sequences": float(r["seq_out"].sum() / seqs),
        }

    @torch.no_grad()
    def _metrics(
        self, lp_det: torch.Tensor, r: dict[str, Any], adv: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor,
        kl: torch.Tensor, dual_active: torch.Tensor,
    ) -> dict[str, float]:
        """The clip, ratio, KL and advantage metrics of one micro-batch, averaged over its loss tokens."""
        n = mask.sum().clamp(min=1)
        pr = r["pg_ratio"].detach()
        low, high = self._clipped(pr, adv, valid)
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

    def _clipped(self, pr: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens where the clip took the gradient away, below and above the range: PPO's pessimistic min binds
        only on the side the advantage pushes the ratio towards."""
        low = valid & (adv < 0) & (pr < 1.0 - self.clip_eps)
        high = valid & (adv > 0) & (pr > 1.0 + self.clip_eps_high)
        return low, high


class GSPOLoss(GRPOLoss):
    """GSPO (Zheng et al. 2025): ``GRPOLoss`` with the sequence-level ratio s_i = exp(mean of sequence i's token
    log-ratios), clipped per sequence (``grpo.algorithms.policy.gspo_clip``): a sequence whose ratio leaves
    [1 - clip_eps, 1 + clip_eps_high] on its advantage's side adds no gradient at any token. Same arguments as
    ``GRPOLoss``; conf/loss/gspo.yaml sets the paper's clip range and the per-sequence aggregation."""

    objective = "gspo_clip"
    objective_pools_sequences = True


class CISPOLoss(GRPOLoss):
    """CISPO (MiniMax-M1, 2025): the importance weight clip(r, 1 - clip_eps, 1 + clip_eps_high), detached, times A
    times the log-prob of every token (``grpo.algorithms.policy.cispo``): every token with a non-zero advantage keeps
    a gradient, bounded by the weight. Same arguments as ``GRPOLoss`` except ``dual_clip`` (refused: the weight is
    bounded already); ``clip_eps=1`` leaves the weight unbounded below, as the paper does."""

    objective = "cispo"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dual_clip") is not None:
            raise ValueError("loss.dual_clip does not apply to CISPO (its importance weight is clipped and detached, "
                             "so no objective is left to floor); set loss.dual_clip=null")
        super().__init__(*args, **kwargs)

    def _clipped(self, pr: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens whose weight was clipped, for either sign of the advantage (their gradient is bounded, not gone)."""
        return valid & (pr < 1.0 - self.clip_eps), valid & (pr > 1.0 + self.clip_eps_high)


def _band(band: Optional[Sequence[float]], key: str) -> Optional[tuple[float, float]]:
    """``[low, high]`` of an off-policy mask as floats, None when off; ValueError naming ``loss.<key>`` unless
    0 < low < 1 < high (a band that excludes ratio 1 would mask the on-policy tokens)."""
    if band is None:
        return None
    values = tuple(float(b) for b in band)
    if len(values) != 2 or not 0 < values[0] < 1 < values[1]:
        raise ValueError(f"loss.{key} must be [low, high] with 0 < low < 1 < high (e.g. [0.5, 2.0]), got {list(band)}")
    return values

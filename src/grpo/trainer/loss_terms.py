"""The terms `grpo.trainer.loss.GRPOLoss` adds around its policy objective, each checking its own settings (the
``loss.*`` keys of the same names) when built: the KL penalty, the entropy bonus, and the off-policy corrections
(the choice of pi_old, truncated importance sampling, the token and sequence masks)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from grpo.algorithms.entropy_control import adapt_entropy_coef
from grpo.algorithms.kl import KL_ESTIMATORS, KLReference
from grpo.algorithms.policy import MAX_LOG_RATIO, OldLogprobs, ratio, sequence_log_ratio


class KLPenalty:
    """``coef x KL(pi || ref)`` per loss token (``loss.kl_coef``, ``loss.kl_estimator``, ``loss.kl_reference``);
    ``coef=0``: no penalty, the estimate still reported as ``grpo/kl``."""

    def __init__(self, coef: float = 0.0, estimator: str = "k3", reference: str = "initial") -> None:
        if coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {coef}")
        self._fn = KL_ESTIMATORS.get(estimator, "kl_estimator")
        if reference not in KLReference.__members__:
            raise ValueError(f"kl_reference must be one of {tuple(KLReference.__members__)}, got {reference!r}")
        self.coef, self.estimator, self.reference = float(coef), estimator, reference

    @property
    def needs_reference_policy(self) -> bool:
        """The penalty is on and measured against the initial policy, whose log-probs the trainer must then pass."""
        return self.coef > 0 and self.reference == KLReference.initial

    def __call__(self, logprobs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate of the policy from ``ref`` (same shape as ``logprobs``)."""
        return self._fn((ref - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))

    def reference_logprobs(self, rollout: torch.Tensor, ref_logprobs: Optional[torch.Tensor],
                           valid: torch.Tensor) -> torch.Tensor:
        """What the estimate measures against: the reference's log-probs where given and finite, else the rollout's.
        ValueError when the penalty needs the initial policy's and none were given."""
        if ref_logprobs is None:
            if self.needs_reference_policy:
                raise ValueError("loss.kl_reference=initial with loss.kl_coef > 0 needs the initial policy's log-probs "
                                 "(ref_logprobs=...); the trainer passes them when it was given a reference policy")
            return rollout
        ref = ref_logprobs.to(rollout.dtype)
        return torch.where(valid & torch.isfinite(ref), ref, rollout)


class EntropyBonus:
    """``-coef x H_t`` per loss token (``loss.entropy_coef``), ``H_t`` the policy's entropy at token t; with
    ``target`` (``loss.entropy_target``) the coefficient is steered after each optimizer step by ``delta`` within
    ``[0, max_coef]`` (`grpo.algorithms.entropy_control`)."""

    def __init__(self, coef: float = 0.0, target: Optional[float] = None, delta: float = 0.005,
                 max_coef: float = 0.5) -> None:
        if coef < 0:
            raise ValueError(f"entropy_coef must be >= 0 (a bonus; a negative one would punish entropy), got {coef}")
        if target is not None and not (target > 0 and delta > 0 and max_coef >= coef):
            raise ValueError(
                "loss.entropy_target needs a target > 0, entropy_coef_delta > 0 and entropy_coef_max >= entropy_coef "
                f"(got {target}, {delta}, {max_coef} >= {coef})")
        self.coef = float(coef)
        self.target = None if target is None else float(target)
        self.delta, self.max_coef = float(delta), float(max_coef)

    @property
    def on(self) -> bool:
        """The loss takes the per-token entropies: the bonus is on, or steered (its coefficient may be 0 now and rise
        later)."""
        return self.coef > 0 or self.target is not None

    def __call__(self, per_token: torch.Tensor, entropy: Optional[torch.Tensor]) -> torch.Tensor:
        """``per_token`` with the bonus subtracted (it is on: ``on``)."""
        if entropy is None:
            raise ValueError("an entropy bonus (loss.entropy_coef > 0 or loss.entropy_target) needs the per-token "
                             "entropies (entropy=...)")
        return per_token - self.coef * entropy.to(per_token.dtype)

    def adapt(self, step_entropy: float) -> None:
        """The next step's coefficient from this step's mean entropy; nothing without a target."""
        if self.target is not None:
            self.coef = adapt_entropy_coef(self.coef, step_entropy, self.target, self.delta, self.max_coef)


@dataclass
class Ratios:
    """What the off-policy corrections make of one micro-batch's log-probs (``[B, T]`` unless noted)."""

    rollout: torch.Tensor  # the rollout log-probs as used: the trainer's own (detached) where missing or not a loss token
    ratio: torch.Tensor  # trainer / rollout, detached
    old: torch.Tensor  # pi_old's log-probs
    pg_log_ratio: torch.Tensor  # log pi - log pi_old: what the objective sees (with grad)
    tis_src: Optional[torch.Tensor]  # the ratio the TIS weights truncate
    tis_w: Optional[torch.Tensor]  # the TIS weights (None without tis_cap)
    sampled: torch.Tensor  # loss tokens with sampler log-probs
    mismatch: torch.Tensor  # log pi_old - log mu at the sampled tokens, 0 elsewhere
    keep: torch.Tensor  # 0 at the tokens the masks drop, 1 elsewhere
    seq_out: torch.Tensor  # [B] sequences the sequence mask drops


class OffPolicyCorrection:
    """pi_old of the ratio (``loss.old_logprobs``), truncated importance sampling (``loss.tis_cap``) and the token
    and sequence masks on the trainer/sampler ratio (``loss.token_mask``, ``loss.sequence_mask``); see GRPOLoss."""

    def __init__(self, old_logprobs: str = "rollout", tis_cap: Optional[float] = None,
                 token_mask: Optional[Sequence[float]] = None, sequence_mask: Optional[Sequence[float]] = None) -> None:
        if tis_cap is not None and tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
        if old_logprobs not in OldLogprobs.__members__:
            raise ValueError(f"old_logprobs must be one of {tuple(OldLogprobs.__members__)}, got {old_logprobs!r}")
        self.old_logprobs, self.tis_cap = old_logprobs, tis_cap
        self.token_mask = _band(token_mask, "token_mask")
        self.sequence_mask = _band(sequence_mask, "sequence_mask")

    @property
    def recomputes_old(self) -> bool:
        """pi_old is the trainer's own log-probs before the rollout batch's first update."""
        return self.old_logprobs == OldLogprobs.recompute

    @property
    def moving_sequence_mask(self) -> bool:
        """The sequence mask on the current log-probs: a token's loss then depends on its sequence's other tokens."""
        return self.sequence_mask is not None and not self.recomputes_old

    def ratios(self, logprobs: torch.Tensor, inference_logprobs: torch.Tensor, valid: torch.Tensor,
               old_logprobs: Optional[torch.Tensor]) -> Ratios:
        """The rollout log-probs as used, the ratio to them, pi_old, the log-ratio the objective sees, the TIS
        weights and the masks."""
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
        return Ratios(rollout, ratio_det, old, logprobs - old, tis_src, tis_w, sampled, mismatch, keep, seq_out)

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
    def metrics(self, r: Ratios, mask: torch.Tensor) -> dict[str, float]:
        """How far the sampler's log-probs are from the trainer's at the sampled tokens (x = log pi_old - log mu):
        ``mismatch/kl`` is KL(mu || pi_old) by Schulman's k3 (exp(x) - 1 - x, samples from mu), ``mismatch/kl_k1``
        the mean of -x; and the share of loss tokens and sequences the off-policy masks dropped. 0 for identical
        log-probs, and when the sampler sent none."""
        x = r.mismatch
        sampled = r.sampled.to(x.dtype)
        n = sampled.sum().clamp(min=1)
        seqs = (mask.sum(dim=1) > 0).sum().clamp(min=1)
        return {
            "mismatch/kl": float(((torch.expm1(x) - x) * sampled).sum() / n),
            "mismatch/kl_k1": float((-x * sampled).sum() / n),
            "mismatch/masked_fraction": float(((1 - r.keep) * mask).sum() / mask.sum().clamp(min=1)),
            "mismatch/masked_sequences": float(r.seq_out.sum() / seqs),
        }

    @torch.no_grad()
    def tis_metrics(self, r: Ratios, mask: torch.Tensor, valid: torch.Tensor, n: torch.Tensor) -> dict[str, Any]:
        """The mean TIS weight and the share of loss tokens whose weight was capped (nothing without ``tis_cap``)."""
        if r.tis_w is None:
            return {}
        return {"grpo/tis_weight": float((r.tis_w * mask).sum() / n),
                "grpo/tis_capped": float((valid & (r.tis_src > self.tis_cap)).sum() / n)}


def _band(band: Optional[Sequence[float]], key: str) -> Optional[tuple[float, float]]:
    """``[low, high]`` of an off-policy mask as floats, None when off; ValueError naming ``loss.<key>`` unless
    0 < low < 1 < high (a band that excludes ratio 1 would mask the on-policy tokens)."""
    if band is None:
        return None
    values = tuple(float(b) for b in band)
    if len(values) != 2 or not 0 < values[0] < 1 < values[1]:
        raise ValueError(f"loss.{key} must be [low, high] with 0 < low < 1 < high (e.g. [0.5, 2.0]), got {list(band)}")
    return values

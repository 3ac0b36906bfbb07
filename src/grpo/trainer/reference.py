"""The reference policy of a KL penalty (``loss.kl_reference=initial``): the run's initial weights, kept frozen.

GRPO's penalty ``beta * KL(pi || pi_ref)`` holds the policy near where it started (DeepSeekMath; TRL's ``beta``,
verl's ``use_kl_loss``). The reference's log-probs are computed once per rollout batch, before its first update, by
the same log-prob function as the policy's (chunks of the output projection; the same packing and prefix layout), and
travel on each micro-batch as ``ref_logprobs``. Two ways to hold pi_ref:

- a frozen copy of the initial weights (full fine-tuning, frozen layers, FSDP2: sharded like the policy), built by
  `grpo.recipes.trainable_model.build_reference_policy` from the initial model directory, also on resume;
- the trained LoRA model itself with its adapter switched off (``peft``'s ``disable_adapter``): the base weights
  never train, so no second copy is needed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch

from grpo.trainer.logprobs import token_logprobs


class ReferencePolicy:
    """Log-probs of the frozen initial policy. ``model`` is a frozen copy of the initial weights, or the trained
    model when ``switched_off`` (a context in which the model computes as its initial weights: a LoRA adapter
    disabled) is given; ``logprob_fn`` replaces ``token_logprobs(model, ...)`` where the model needs its own (an
    FSDP2-sharded copy's registered method)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        switched_off: Optional[Callable[[], ContextManager[Any]]] = None,
        logprob_fn: Optional[Callable[..., torch.Tensor]] = None,
    ) -> None:
        self.model = model
        self.switched_off = switched_off or contextlib.nullcontext
        self.logprob_fn = logprob_fn
        self.shares_policy_weights = switched_off is not None

    @classmethod
    def frozen_copy(cls, model: torch.nn.Module, logprob_fn: Optional[Callable[..., torch.Tensor]] = None,
                    ) -> "ReferencePolicy":
        """pi_ref held by ``model``, a copy of the initial weights that never trains (its gradients are turned off)."""
        model.requires_grad_(False)
        return cls(model, logprob_fn=logprob_fn)

    @classmethod
    def adapter_off(cls, peft_model: torch.nn.Module, logprob_fn: Optional[Callable[..., torch.Tensor]] = None,
                    ) -> "ReferencePolicy":
        """pi_ref as the trained PEFT model with its adapter disabled: the base weights, which LoRA never trains.
        ``logprob_fn``: the model's FSDP2 log-prob method when it is sharded."""
        return cls(peft_model, switched_off=peft_model.disable_adapter, logprob_fn=logprob_fn)

    @torch.no_grad()
    def logprobs(self, *batch: torch.Tensor, **layout: Any) -> torch.Tensor:
        """``token_logprobs`` of the reference for one micro-batch's ``(input_ids, attention_mask, labels,
        temperatures)`` and the trainer's layout keywords (chunk size, packing, prefix sharing)."""
        # Train mode as the policy's updates use it, so pi_ref equals the policy exactly before the first update.
        self.model.train()
        with self.switched_off():
            if self.logprob_fn is not None:
                return self.logprob_fn(*batch, **layout).detach()
            return token_logprobs(self.model, *batch, **layout).detach()

    def close(self) -> None:
        """Let go of the copy's weights (a multirun's next job must not find them on the device)."""
        self.model = None
        self.logprob_fn = None

    def __repr__(self) -> str:
        how = "the trained model with its adapter off" if self.shares_policy_weights else "a frozen copy"
        return f"ReferencePolicy({how})"

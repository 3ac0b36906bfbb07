"""What the trainer knows of a loss: what it needs (``LossNeeds``), what it is given (``LossInputs``) and the calls it
makes (``PolicyLoss``). `grpo.trainer.loss.GRPOLoss` is the loss every ``conf/loss/*.yaml`` builds; a loss of your own
subclasses ``PolicyLoss``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from grpo.algorithms.aggregation import Totals
from grpo.config_values import CheckContext, ConfigError
from grpo.trainer.reference import ReferencePolicy


@dataclass(frozen=True)
class LossNeeds:
    """What a loss asks of the trainer, and what it promises about its gradient. The trainer reads it once, when it
    is given the loss (after a resumed run's ``load_state_dict``).

    Args:
        reference_policy: the frozen initial policy's log-probs as ``LossInputs.ref_logprobs`` (a KL penalty against
            the initial weights): the trainer is then given a `grpo.trainer.reference.ReferencePolicy` and fills
            them in once per rollout batch.
        recomputed_old_logprobs: pi_old recomputed by the trainer before a rollout batch's first update (one forward
            without grad) as ``LossInputs.old_logprobs``; otherwise the rollout (vLLM) log-probs serve.
        entropy: the policy's per-token entropies, with their gradient, as ``LossInputs.entropy`` (an entropy bonus).
        token_separable: the gradient at token i depends on ``logprobs[i]`` alone (every other input is a constant
            or a normaliser): the fused log-prob path then takes each chunk's gradient before the next chunk's
            log-probs exist; otherwise it takes two passes.
        zero_advantage_adds_nothing: a token whose advantage is 0 adds nothing to the loss or its gradient, so
            ``train.skip_zero_advantage`` may leave such rows out of the forward passes.
    """

    reference_policy: bool = False
    recomputed_old_logprobs: bool = False
    entropy: bool = False
    token_separable: bool = False
    zero_advantage_adds_nothing: bool = False


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors for the loss (``[B, T]`` unless noted) and the whole optimizer step's normalisers.

    Args:
        logprobs: the trainer's log-probs of the labels (with grad).
        inference_logprobs: the rollout (vLLM) log-probs; NaN = not sent (that token is treated as on-policy).
        advantages: ``[B]`` or ``[B, T]``.
        mask: 1 at completion tokens that carry loss.
        ref_logprobs: reference log-probs for a KL penalty: the initial policy's (``LossNeeds.reference_policy``), or
            an environment's, NaN where missing; None = the rollout log-probs.
        old_logprobs: pi_old recomputed by the trainer (``LossNeeds.recomputed_old_logprobs``); None = the rollout
            log-probs are pi_old.
        entropy: the policy's per-token entropies (with grad), given when ``LossNeeds.entropy``.
        totals: the optimizer step's loss tokens, sequences and longest completion, for gradient accumulation
            (a None total: this micro-batch's own), so that the micro-batch losses add up to the full batch's.
    """

    logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    totals: Totals = field(default_factory=Totals)


class PolicyLoss(ABC):
    """A loss the trainer can train with: ``loss(inputs, with_metrics) -> (scalar, metrics)`` and what it needs
    (``needs``). ``adapt``, ``state_dict`` and ``load_state_dict`` are for a loss that changes as it trains (the
    entropy bonus's steered coefficient); by default it does not."""

    @classmethod
    def check_config(cls, cfg: Any, ctx: CheckContext) -> None:
        """Checks of the run's config (`cfg`, the whole of it: the loss's node is `ctx.node(cfg)`) against this loss,
        before anything is built (grpo.config.validate): a ConfigError saying what to set. None by default."""

    @property
    @abstractmethod
    def needs(self) -> LossNeeds:
        """What this loss asks of the trainer (see ``LossNeeds``)."""

    @abstractmethod
    def __call__(self, inputs: LossInputs, with_metrics: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch, normalised by ``inputs.totals``, and its python-float metrics averaged over
        the micro-batch's loss tokens; ``with_metrics=False`` skips the metrics (each is a device sync)."""

    def adapt(self, step_entropy: float) -> None:
        """After an optimizer step: the step's mean policy entropy (``grpo/entropy``, reduced over ranks)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the loss (handed back through ``load_state_dict`` on resume)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict``'s values."""


def take_loss(loss_fn: PolicyLoss, loss_state: Optional[dict[str, Any]],
              reference: Optional[ReferencePolicy]) -> LossNeeds:
    """What `loss_fn` asks of the trainer, read once, after a resumed run's `loss_state` (what the loss had adapted to,
    which may turn an entropy bonus on). TypeError for anything but a `PolicyLoss`; ConfigError for a loss that needs
    the initial policy when the trainer was given none."""
    if not isinstance(loss_fn, PolicyLoss):
        raise TypeError(f"loss_fn must be a grpo.trainer.loss_interface.PolicyLoss (it declares what it needs), "
                        f"got {type(loss_fn).__name__}")
    if loss_state:
        loss_fn.load_state_dict(loss_state)
    needs = loss_fn.needs
    if needs.reference_policy and reference is None:
        raise ConfigError(f"{loss_fn!r} measures its KL penalty against the initial policy, and the trainer was "
                          "given none (reference=ReferencePolicy...; train.py builds it)")
    return needs


def check_skip_zero_advantage(skip: bool, loss_fn: PolicyLoss) -> None:
    """`train.skip_zero_advantage` needs a loss that gains nothing from rows whose advantage is 0 everywhere."""
    if skip and not loss_fn.needs.zero_advantage_adds_nothing:
        raise ConfigError(
            "train.skip_zero_advantage=true leaves rows with advantage 0 out of the forward passes, which keeps "
            f"the gradients only for a loss that gains nothing from them; {loss_fn!r} does (a KL penalty, an "
            "entropy bonus, or a loss whose needs do not declare zero_advantage_adds_nothing). Set loss.kl_coef=0 "
            "and loss.entropy_coef=0, or train.skip_zero_advantage=false"
        )

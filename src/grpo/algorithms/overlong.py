"""Completions cut by the length limit: masked out of the loss, and DAPO's soft overlong penalty on the reward.

A completion that stopped at ``max_new_tokens`` without EOS is *truncated*: its reward judges an unfinished answer.
Two remedies (``loss.mask_truncated``, ``loss.overlong_buffer``), both applied by the batcher
(`grpo.pipeline.batching`) to each sequence before advantages are computed:

- masking (TRL's ``mask_truncated_completions``): the sequence's reward still joins its group's baseline, but the
  sequence itself adds no loss, no gradient and nothing to the normalisers (``masked_out``);
- soft overlong penalty (DAPO, Yu et al. 2025; verl's ``reward_model.overlong_buffer``): the reward gets a penalty
  growing linearly from 0 to ``-factor`` over the last ``buffer`` tokens before the limit (``soft_overlong_penalty``),
  so the advantage comes from the shaped reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def soft_overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 for ``length <= max_length - buffer``, then ``-factor`` x the share of the
    buffer used, so ``-factor`` at ``length == max_length`` (and beyond). A buffer longer than ``max_length`` spans the
    whole completion (a round whose limit was lowered for long prompts still ramps from 0)."""
    if buffer < 1 or max_length < 1:
        raise ValueError(f"the overlong buffer and the length limit must be >= 1, got {buffer} and {max_length}")
    buffer = min(buffer, max_length)
    exceed = length - (max_length - buffer)
    return -factor * min(exceed, buffer) / buffer if exceed > 0 else 0.0


def masked_out(truncated: Optional[bool], mask_truncated: bool) -> bool:
    """True when a sequence is left out of the loss: masking is on and the sequence was truncated."""
    return bool(mask_truncated and truncated)


@dataclass(frozen=True)
class TruncationRule:
    """What happens to truncated or nearly truncated completions (the ``loss`` keys of the same names).

    Args:
        mask_truncated: truncated completions add no loss, gradient or normaliser count.
        overlong_buffer: tokens before the completion limit over which the soft penalty grows; None disables it.
        overlong_penalty_factor: the penalty at the limit (subtracted from the reward).
    """

    mask_truncated: bool = False
    overlong_buffer: Optional[int] = None
    overlong_penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.overlong_buffer is not None and self.overlong_buffer < 1:
            raise ValueError(f"loss.overlong_buffer must be >= 1 token (null disables the penalty), "
                             f"got {self.overlong_buffer}")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"loss.overlong_penalty_factor must be >= 0 (the penalty is subtracted), "
                             f"got {self.overlong_penalty_factor}")

    @property
    def needs_truncation(self) -> bool:
        """True when each sequence must say whether it was truncated (masking is on)."""
        return self.mask_truncated

    @property
    def needs_length_limit(self) -> bool:
        """True when each group must say the completion limit it was sampled under (the penalty is on)."""
        return self.overlong_buffer is not None

    def penalty(self, length: int, max_length: int) -> float:
        """The reward's penalty for a completion of ``length`` tokens sampled under ``max_length`` (0 when off)."""
        if self.overlong_buffer is None:
            return 0.0
        return soft_overlong_penalty(length, max_length, self.overlong_buffer, self.overlong_penalty_factor)

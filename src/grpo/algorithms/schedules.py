"""Learning-rate schedules after warm-up (``train.lr_schedule`` names one): ``fn(progress) -> multiplier`` of the
peak learning rate, ``progress`` in [0, 1] from the end of warm-up to the last step (`grpo.trainer.optim` adds the
warm-up)."""

from __future__ import annotations

import math
from typing import Callable

from grpo.algorithms.registry import Registry

Schedule = Callable[[float], float]
LR_SCHEDULES: Registry[Schedule] = Registry("learning-rate schedule")


@LR_SCHEDULES.register("constant")
def constant(progress: float) -> float:
    """The peak learning rate throughout."""
    return 1.0


@LR_SCHEDULES.register("linear")
def linear(progress: float) -> float:
    """Linear decay to 0 at the last step."""
    return 1.0 - progress


@LR_SCHEDULES.register("cosine")
def cosine(progress: float) -> float:
    """Half a cosine down to 0 at the last step."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))

"""Schemas of the optimizer group: one per option, its fields the optimizer constructor's kwargs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class AdamWConfig:
    """torch.optim.AdamW."""

    _target_: str = "torch.optim.AdamW"
    # Peak learning rate (after warmup); 1e-3 suits the tiny CPU models, real models want ~1e-6 to 1e-5.
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    # torch's fused AdamW kernel (one launch per step instead of a foreach loop); null = torch's default. torch
    # optimizers only: not passed when null.
    fused: Optional[bool] = None


@dataclass
class AdamW8bitConfig(AdamWConfig):
    """bitsandbytes AdamW with 8-bit optimizer states."""

    _target_: str = "bitsandbytes.optim.AdamW8bit"


@dataclass
class AdafactorConfig:
    """transformers Adafactor with an external learning rate (no relative step)."""

    _target_: str = "transformers.optimization.Adafactor"
    # Peak learning rate (external: relative_step is off).
    lr: float = 1e-3
    weight_decay: float = 0.0
    scale_parameter: bool = False
    relative_step: bool = False
    warmup_init: bool = False
    clip_threshold: float = 1.0

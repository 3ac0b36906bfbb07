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
    # Adam moment decay rates.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # Adam denominator epsilon.
    eps: float = 1e-8
    # Decoupled weight decay; never applied to norms and biases.
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
    # Weight decay; never applied to norms and biases.
    weight_decay: float = 0.0
    # Scale the update by the parameter RMS (off: the lr is absolute).
    scale_parameter: bool = False
    # Adafactor's own time-dependent lr (off: our schedule drives the lr).
    relative_step: bool = False
    # Adafactor's own warmup (off: train.warmup_steps does it).
    warmup_init: bool = False
    # Update clipping threshold of Adafactor.
    clip_threshold: float = 1.0

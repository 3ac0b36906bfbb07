"""Optimizer and learning-rate schedule construction from the ``optimizer`` config group.

The optimizer class comes from the config's ``_target_`` and is never swapped silently: if its package cannot be
imported (bitsandbytes for ``adamw_8bit``), start-up fails with the package to install.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from grpo.algorithms.schedules import LR_SCHEDULES

log = logging.getLogger(__name__)

# Where each optimizer's package comes from, for the error message.
_INSTALL_HINTS = {
    "bitsandbytes": "pip install bitsandbytes (or choose optimizer=adamw / optimizer=adafactor)",
    "transformers": "pip install transformers",
}


class OptimizerUnavailableError(ImportError):
    """The configured optimizer's package is not installed (no fallback to another optimizer is made)."""


def _as_dict(cfg: Any) -> dict:
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    d = dict(cfg)
    d.pop("defaults", None)  # present when a group YAML is loaded with OmegaConf.load
    return d


def check_optimizer_available(optimizer_cfg: Any) -> type:
    """Import the optimizer class named by ``_target_`` and return it; raise ``OptimizerUnavailableError`` naming
    the package to install when it can't be imported. Call at start-up, before any model loads."""
    target = _as_dict(optimizer_cfg).get("_target_")
    if not target or "." not in target:
        raise ValueError(f"optimizer config needs a dotted _target_, got {target!r}")
    module_name, attr = target.rsplit(".", 1)
    package = module_name.split(".")[0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = _INSTALL_HINTS.get(package, f"pip install {package}")
        raise OptimizerUnavailableError(
            f"optimizer {target} needs the package {package!r}, which failed to import ({e}). Install it: {hint}. "
            "No other optimizer is substituted."
        ) from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise OptimizerUnavailableError(f"optimizer {target}: {module_name} has no attribute {attr!r}")
    return cls


def _no_decay(name: str, param: nn.Parameter) -> bool:
    # Norm scales, biases and any other 1-D parameter are not decayed: shrinking them toward 0 is not a
    # regulariser, it distorts the activations.
    lname = name.lower()
    return param.ndim < 2 or lname.endswith(".bias") or "norm" in lname


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into a decayed group and a ``weight_decay=0`` group (norms, biases, 1-D)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if _no_decay(name, p) else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return groups


def build_optimizer(model: nn.Module, optimizer_cfg: Any) -> torch.optim.Optimizer:
    """Instantiate the configured optimizer on the model's trainable parameters (norms/biases without decay)."""
    check_optimizer_available(optimizer_cfg)
    # An unset (null) option is the optimizer's own default, so it is not passed (bitsandbytes has no `fused`).
    cfg = {k: v for k, v in _as_dict(optimizer_cfg).items() if v is not None}
    groups = param_groups(model, float(cfg.get("weight_decay", 0.0) or 0.0))
    # instantiate(cfg, params=groups) would wrap the group dicts in DictConfigs, which optimizers reject: build a
    # partial from the config and call it with the plain groups.
    factory = instantiate(cfg, _partial_=True)
    return factory(groups)


def lr_lambda(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier at ``step`` (0-based count of optimizer steps taken): linear warmup reaching 1 at
    ``warmup_steps``, then the registered schedule (`grpo.algorithms.schedules`: constant, linear to 0 or cosine to 0
    at ``total_steps``)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return LR_SCHEDULES.get(schedule, "train.lr_schedule")(progress)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int) -> LambdaLR:
    """A ``LambdaLR`` for ``constant`` / ``linear`` / ``cosine`` with linear warmup (see ``lr_lambda``)."""
    LR_SCHEDULES.get(schedule, "train.lr_schedule")  # an unknown name fails here, not at the first step
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
    if warmup_steps >= total_steps:
        # A run shortened with train.steps=N keeps its job's warmup (the default job: 10 steps), so the whole run
        # warms up: said, at INFO, since a short trial run (the README's train.steps=10) is the usual cause and is
        # no mistake; a WARNING there was noise on every such run.
        peak = lr_lambda(total_steps - 1, schedule, warmup_steps, total_steps)
        log.info("train.warmup_steps=%d is not below train.steps=%d: the learning rate warms up for the whole run and "
                 "peaks at %.0f%% of optimizer.lr (train.warmup_steps=0 for none)", warmup_steps, total_steps, 100 * peak)
    return LambdaLR(optimizer, lambda s: lr_lambda(s, schedule, warmup_steps, total_steps))


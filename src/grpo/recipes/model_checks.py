"""Checks of `model.*` before any weight loads, beside the recipes that build or find the initial weights (which
know the presets): a known attention kernel, an offline preset that exists, a local model directory that holds a
model with the block count `model.num_layers` says, a hub id that is cached or reachable. Each raises ConfigError."""

from __future__ import annotations

import difflib
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import try_to_load_from_cache
from omegaconf import DictConfig

from grpo.config_values import ConfigError
from grpo.models.loading import ATTN_IMPLEMENTATIONS
from grpo.models.packaged import PACKAGED_MODELS, PackagedModelMissing, gguf_path
from grpo.models.tiny import offline_presets
from grpo.recipes.warmstart import WARMSTART_PRESETS

# Files whose presence makes a directory a model: a config plus weights in any format transformers loads.
MODEL_FILES = ("config.json",)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.safetensors.index.json")


def check_model(cfg: DictConfig, cuda: bool) -> None:
    """A known attention kernel (FlexAttention on a CUDA trainer only); a local `model.name` exists; a hub id not
    in the local cache is refused when the hub is off or cannot be reached."""
    attn = cfg.model.attn_implementation
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"model.attn_implementation={attn} is not one of {', '.join(ATTN_IMPLEMENTATIONS)} "
                          "(or null for transformers' default)")
    trains_on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not cuda)
    if attn == "flex_attention" and trains_on_cpu:
        raise ConfigError("model.attn_implementation=flex_attention needs a CUDA trainer (PyTorch's FlexAttention "
                          "has no backward pass on CPU); use sdpa, null or varlen (packed rows per sequence) on this machine")
    if cfg.model.offline is not None:
        check_offline_preset(str(cfg.model.offline))
        return
    name = cfg.model.name
    looks_local = name.startswith(("/", ".", "~")) or os.path.isabs(name)
    if looks_local and not Path(name).expanduser().exists():
        raise ConfigError(f"model.name={name} does not exist")
    if looks_local or Path(name).exists():
        return
    cached_config = _hub_cached_config(name)
    if cached_config is not None:
        check_layer_count(cfg.model, cached_config)
        return
    instead = (f"point model.name at a local directory or set model.offline=<preset> for random weights of a known "
               f"shape ({', '.join(offline_presets())})")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(f"model.name={name} is a hub id, not in the local Hugging Face cache, and HF_HUB_OFFLINE=1; "
                          f"{instead}")
    reachable, where = _hub_reachable()
    if not reachable:
        # Without this the hub client retries for about a minute and ends in a traceback.
        raise ConfigError(f"model.name={name} is a hub id, not in the local Hugging Face cache, and the hub "
                          f"({where}) cannot be reached from here; {instead}, or fix the network (HF_ENDPOINT, proxy)")


def check_offline_preset(preset: str) -> None:
    """`model.offline` names a preset the model builder knows; else its ValueError was a traceback after the run's
    start-up lines. The model options' own names (`tiny_qwen2`, `warm_arith`) are the natural misspelling."""
    known = [*offline_presets(), *sorted(WARMSTART_PRESETS), *sorted(PACKAGED_MODELS)]
    if preset in PACKAGED_MODELS:
        try:
            gguf_path(preset)  # the package that carries it is installed: said before vLLM or the build starts
        except PackagedModelMissing as e:
            raise ConfigError(str(e)) from None
    if preset in known:
        return
    close = difflib.get_close_matches(preset.replace("_", "-"), known, n=1)
    hint = f"; did you mean model.offline={close[0]}?" if close else ""
    raise ConfigError(f"model.offline={preset} is not an offline model preset (those are {', '.join(known)}){hint} "
                      "(model.offline=null loads model.name instead)")


def _hub_cached_config(name: str) -> Path | None:
    """The hub model's config.json in the local Hugging Face cache, or None."""
    found = try_to_load_from_cache(name, "config.json")
    return Path(found) if isinstance(found, str) else None


def _hub_reachable(timeout_s: float = 3.0) -> tuple[bool, str]:
    """(whether a TCP connection to the hub's host opens within `timeout_s`, "host:port"); HF_ENDPOINT names the
    hub. Behind a proxy only the hub client knows the way, so it is given the benefit of the doubt."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True, f"{host}:{port}"
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False, f"{host}:{port}"
    return True, f"{host}:{port}"


def check_model_files(model_cfg: DictConfig) -> None:
    """A local model directory must hold a model (config.json and weights), not fail later in the tokenizer."""
    if model_cfg.offline:
        return
    path = Path(str(model_cfg.name)).expanduser()
    if not path.is_dir():
        return
    missing = [f for f in MODEL_FILES if not (path / f).is_file()]
    has_weights = any(any(path.glob(p)) for p in WEIGHT_PATTERNS)
    if missing or not has_weights:
        found = sorted(p.name for p in path.iterdir())[:10]
        raise ConfigError(
            f"no model files in {path} (model.name): expected config.json and weights (*.safetensors or *.bin); "
            f"found {found or 'nothing'}"
        )
    check_layer_count(model_cfg, path / "config.json")


def check_layer_count(model_cfg: DictConfig, config_json: Path) -> None:
    """`model.num_layers` is the model's block count: layer specs resolve against it, so a smaller value left at a
    preset's default made `layers=all` train only the first blocks (embeddings and head frozen), silently."""
    try:
        hf_config = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return  # loading the model says what is wrong with it
    hf_config = hf_config.get("text_config", hf_config)  # multimodal configs nest the language model's
    blocks = next((hf_config[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in hf_config), None)
    if isinstance(blocks, int) and blocks != model_cfg.num_layers:
        raise ConfigError(
            f"model.num_layers={model_cfg.num_layers}, but {config_json} says the model has {blocks} blocks; set "
            f"model.num_layers={blocks} (layers=... resolves against it)"
        )

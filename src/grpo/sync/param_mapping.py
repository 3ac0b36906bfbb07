"""Map Hugging Face parameter names onto vLLM's (fused) parameters, as row slices.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (rows stacked in that order, tensor parallel size
1), pads the vocabulary rows of `embed_tokens`/`lm_head` up to a multiple of 64, drops `lm_head.weight` when the
embeddings are tied, and inserts `.base_layer.` into the names of LoRA-wrapped layers. Each HF parameter is a
contiguous row range `[start, stop)` of exactly one vLLM parameter, so `vllm_tensor[start:stop]` is a view that an
optimizer can update in place.

Pure logic (names and shapes only) so it is testable on CPU; `build_views` turns a plan into tensors. Every HF
parameter must be mapped and every vLLM parameter used: anything else raises `MappingError` (never zero-fill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from grpo.config_values import option

# HF projection -> (vLLM fused projection, index of the shard in the fused rows).
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class MappingError(RuntimeError):
    """An HF parameter has no vLLM counterpart (or a shape disagrees): sharing weights would be wrong."""


@dataclass(frozen=True)
class ParamSlice:
    """HF parameter `hf_name` is rows [start, stop) of vLLM parameter `vllm_name`."""

    hf_name: str
    vllm_name: str
    start: int
    stop: int


def normalize_vllm_name(name: str) -> str:
    """vLLM's name without LoRA wrapping (`qkv_proj.base_layer.weight` -> `qkv_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def shard_sizes(config: Any) -> dict[str, list[int]]:
    """Row counts of the shards of each fused projection, from an HF config (Llama / Qwen2 families)."""
    hidden = option(config, "hidden_size")
    heads = option(config, "num_attention_heads")
    kv_heads = option(config, "num_key_value_heads") or heads
    head_dim = option(config, "head_dim") or hidden // heads
    inter = option(config, "intermediate_size")
    return {
        "qkv_proj": [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
        "gate_up_proj": [inter, inter],
    }


def plan_mapping(
    hf_shapes: Mapping[str, Sequence[int]],
    vllm_shapes: Mapping[str, Sequence[int]],
    config: Any,
) -> dict[str, ParamSlice]:
    """For each HF parameter, the vLLM parameter and row range it lives in.

    `hf_shapes`: HF model's `{name: shape}` (named_parameters; a tied lm_head may be listed or not).
    `vllm_shapes`: vLLM model's `{name: shape}` (`.base_layer.` allowed). `config`: HF config (or dict).
    Raises MappingError listing every HF parameter that could not be mapped, every shape mismatch, and every
    vLLM parameter left unused.
    """
    vllm = {normalize_vllm_name(n): tuple(s) for n, s in vllm_shapes.items()}
    sizes = shard_sizes(config)
    tied = bool(option(config, "tie_word_embeddings", False))
    plan: dict[str, ParamSlice] = {}
    problems: list[str] = []
    for hf_name, hf_shape in hf_shapes.items():
        hf_shape = tuple(hf_shape)
        module, _, leaf = hf_name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in FUSED_PROJECTIONS and leaf in ("weight", "bias"):
            fused, idx = FUSED_PROJECTIONS[proj]
            target = f"{parent}.{fused}.{leaf}"
            start = sum(sizes[fused][:idx])
            stop = start + sizes[fused][idx]
        elif hf_name == "lm_head.weight" and (tied or "lm_head.weight" not in vllm):
            # Tied: vLLM keeps one tensor for both (named embed_tokens); the HF head is the same view.
            target, start, stop = "model.embed_tokens.weight", 0, hf_shape[0]
        elif hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            target, start, stop = hf_name, 0, hf_shape[0]  # vLLM pads the vocabulary rows
        else:
            target = hf_name
            start, stop = 0, hf_shape[0] if hf_shape else 0
        if target not in vllm:
            problems.append(f"{hf_name}: no vLLM parameter {target}")
            continue
        v_shape = vllm[target]
        want = (stop - start, *v_shape[1:]) if v_shape else ()
        if not v_shape or stop > v_shape[0] or want != hf_shape:
            problems.append(f"{hf_name} {hf_shape}: rows [{start}:{stop}) of {target} {v_shape} do not fit")
            continue
        plan[hf_name] = ParamSlice(hf_name, target, start, stop)
    used = {p.vllm_name for p in plan.values()}
    problems += [f"vLLM parameter {n} is not covered by any HF parameter" for n in vllm if n not in used]
    if problems:
        raise MappingError("cannot map the HF model onto vLLM's parameters:\n  " + "\n  ".join(problems))
    # The slices must tile each vLLM parameter exactly, or some rows would be trained by nobody (or twice).
    for name, shape in vllm.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue  # rows past the vocabulary are padding, never read
        pos = 0
        for a, b in sorted({(p.start, p.stop) for p in plan.values() if p.vllm_name == name}):
            if a != pos:
                raise MappingError(f"rows [{pos}:{a}) of {name} {shape} are not covered (or overlap)")
            pos = b
        if pos != shape[0]:
            raise MappingError(f"HF parameters cover rows [0:{pos}) of {name} {shape}, not all of it")
    return plan


def build_views(plan: Mapping[str, ParamSlice], vllm_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{hf_name: view}`: row-slice views of vLLM's tensors (contiguous, sharing storage)."""
    tensors = {normalize_vllm_name(n): t for n, t in vllm_tensors.items()}
    views = {}
    for hf_name, s in plan.items():
        if s.vllm_name not in tensors:
            raise MappingError(f"{hf_name}: vLLM tensor {s.vllm_name} was not exported")
        views[hf_name] = tensors[s.vllm_name][s.start : s.stop]
    return views


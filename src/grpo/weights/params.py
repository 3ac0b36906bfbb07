"""Full parameters of a model that may be sharded with FSDP2 (torchrun): detection and gathers.

Every gather here is a collective when the model is sharded: all ranks must call it, in the same order. Without
sharding the functions return the module's own tensors and communicate nothing.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from grpo.weights.hf_dir import is_peft, save_model_weights


def is_sharded(model: nn.Module) -> bool:
    """True when `model` holds FSDP2 (DTensor) parameters, whose full values only a collective can read."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def iter_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter in `named_parameters` order. FSDP2 parameters (DTensors) are gathered
    with `full_tensor()` -- a collective, so every rank must iterate to the end -- plain ones are returned as is."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        t = p.detach()
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


def drain_full_params(model: nn.Module) -> None:
    """The non-sending ranks' side of a weight sync: take part in every gather, keep nothing."""
    for _ in iter_full_params(model):
        pass


def full_trainable_params(model: nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """The parameters that train (a LoRA adapter's, the base frozen), full and on CPU on rank 0 (empty elsewhere),
    and the bytes of the full tensors gathered from shards (0 when nothing is sharded). One `full_tensor()` per
    trainable FSDP2 parameter, a collective: every rank must call it; frozen parameters are never gathered."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    keep = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    gathered = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
            gathered += t.numel() * t.element_size()
        if keep:
            out[name] = t.cpu()
    return out, gathered


def trainable_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that train, at their full (unsharded) size: a LoRA adapter's size."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict on rank 0, on CPU; empty on the other ranks. A collective. For a PEFT model only
    the parameters that train (its adapter): the frozen base is the initial model directory's, never gathered."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(model))


def _full_options(model: nn.Module) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=is_peft(model))


def full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Full model and optimizer state dicts on rank 0, on CPU (empty on the other ranks); the optimizer's keyed by
    parameter name. Collectives: every rank must call it. The optimizer's is None without an optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model_state = full_state_dict(model)
    if optimizer is None:
        return model_state, None
    return model_state, get_optimizer_state_dict(model, optimizer, options=_full_options(model))


def save_full_weights(model: nn.Module, tokenizer: Any, out_dir: Any, durable: bool = True) -> Any:
    """HF-format weights of `model` in `out_dir`, written atomically (`durable`: fsynced, see
    `save_model_weights`). For an FSDP2 model the full weights are gathered first: a collective, which every rank
    joins (the others get nothing to write)."""
    state_dict = full_state_dict(model) if is_sharded(model) else None
    return save_model_weights(model, tokenizer, out_dir, state_dict, durable=durable)

"""Full parameters of a model that may be sharded with FSDP2 (torchrun): detection and gathers.

Every gather here is a collective when the model is sharded: all ranks must call it, in the same order. Without
sharding the functions return the module's own tensors and communicate nothing.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from grpo.weights.hf_dir import save_model_weights


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


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict on rank 0, on CPU; empty on the other ranks. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Full model and optimizer state dicts on rank 0, on CPU (empty on the other ranks); the optimizer's keyed by
    parameter name. Collectives: every rank must call it. The optimizer's is None without an optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model_state = full_state_dict(model)
    if optimizer is None:
        return model_state, None
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return model_state, get_optimizer_state_dict(model, optimizer, options=options)


def save_full_weights(model: nn.Module, tokenizer: Any, out_dir: Any, durable: bool = True) -> Any:
    """HF-format weights of `model` in `out_dir`, written atomically (`durable`: fsynced, see
    `save_model_weights`). For an FSDP2 model the full weights are gathered first: a collective, which every rank
    joins (the others get nothing to write)."""
    state_dict = full_state_dict(model) if is_sharded(model) else None
    return save_model_weights(model, tokenizer, out_dir, state_dict, durable=durable)

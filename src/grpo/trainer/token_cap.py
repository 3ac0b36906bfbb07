"""The default bound on the tokens one micro-batch forwards (`train.auto_token_budget`), so that a task with long
completions does not meet an out-of-memory error at micro_batch_size rows: on a GPU derived from the device's free
memory and the model's size, on CPU a fixed number above what the built-in jobs forward.

Derivation on CUDA (at the trainer's construction, after the server and the model took their memory): the free
memory, less what the first optimizer step still allocates (gradients and two AdamW moments of the trainable
parameters), times ACTIVATION_SHARE (room for the allocator's fragmentation, the loss's chunks of logits and the
transient buffers of the backward) over the activations one forward saves per token for its backward.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from grpo.schema.train import TrainConfig
from grpo.trainer import fsdp

log = logging.getLogger(__name__)

# On CPU: a micro-batch forwards at most this many tokens (the default job's largest micro-batch is 64 x 64 = 4096,
# so it never binds there).
CPU_TOKEN_CAP = 65536
# Bounds of a derived cap (a GPU with little free memory still trains; rounding keeps the logged number readable).
MIN_TOKEN_CAP, MAX_TOKEN_CAP, CAP_ROUNDING = 1024, 1 << 20, 1024
# Share of the memory left after the optimizer's first step that the saved activations may take.
ACTIVATION_SHARE = 0.5


def activation_bytes_per_token(config: Any, dtype_bytes: int, checkpointing: bool = False) -> Optional[int]:
    """Bytes one token's forward keeps for the backward, from a decoder config (hidden_size, intermediate_size,
    num_hidden_layers): per layer about 16 hidden-size and 6 MLP-size tensors (norms, q/k/v/o, residuals, the MLP's
    gate, up, activation and product). With gradient checkpointing each layer keeps its input only, and one layer
    at a time recomputes the rest. None when the config lacks those sizes."""
    hidden = getattr(config, "hidden_size", None)
    inner = getattr(config, "intermediate_size", None) or (4 * hidden if hidden else None)
    layers = getattr(config, "num_hidden_layers", None)
    if not (hidden and inner and layers):
        return None
    per_layer = (16 * hidden + 6 * inner) * dtype_bytes
    return (layers * 2 * hidden * dtype_bytes + per_layer) if checkpointing else layers * per_layer


def derived_token_cap(model: torch.nn.Module, device: torch.device, free_bytes: Optional[int] = None
                      ) -> tuple[int, str]:
    """(tokens, how they were derived): the cap on a micro-batch's forward for `model` on `device` (module
    docstring). `free_bytes` stands for the device's free memory (None: asked of CUDA)."""
    if device.type != "cuda" and free_bytes is None:
        return CPU_TOKEN_CAP, "the CPU default"
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() * p.element_size() for p in params)
    dtype_bytes = params[0].element_size() if params else 4
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    per_token = activation_bytes_per_token(getattr(model, "config", None), dtype_bytes, checkpointing)
    if per_token is None:  # not a transformers decoder: a bound of the same order as the CPU default
        return CPU_TOKEN_CAP, "the default for a model without decoder sizes in its config"
    spare = max(free_bytes - 3 * trainable, 0) * ACTIVATION_SHARE
    tokens = int(spare // per_token) // CAP_ROUNDING * CAP_ROUNDING
    tokens = min(max(tokens, MIN_TOKEN_CAP), MAX_TOKEN_CAP)
    return tokens, (f"{ACTIVATION_SHARE:.0%} of the {free_bytes / 2**30:.1f} GiB free after the optimizer's "
                    f"{3 * trainable / 2**30:.1f} GiB, at {per_token / 2**20:.2f} MiB of activations per token")


def micro_batch_token_cap(train_cfg: TrainConfig, model: torch.nn.Module, device: torch.device,
                          dist: Optional[fsdp.DistInfo]) -> Optional[int]:
    """The token cap on top of micro_batch_size rows (None: an explicit budget or none), said in the log."""
    if train_cfg.max_tokens_per_micro_batch is not None:
        log.info("micro-batches: by a budget of %d forwarded tokens (train.max_tokens_per_micro_batch)",
                 train_cfg.max_tokens_per_micro_batch)
        return None
    if not getattr(train_cfg, "auto_token_budget", True):
        log.info("micro-batches: %d rows, no token bound (train.auto_token_budget=false)", train_cfg.micro_batch_size)
        return None
    cap, how = derived_token_cap(model, device)
    if dist is not None and dist.enabled:  # every rank must split alike (the forwards are collectives): the smallest cap
        bound = torch.tensor([cap], device=device)
        torch.distributed.all_reduce(bound, op=torch.distributed.ReduceOp.MIN)
        cap = int(bound.item())
    log.info("micro-batches: %d rows (train.micro_batch_size), split further where a forward would run more than "
             "%d tokens (train.auto_token_budget: %s; set train.max_tokens_per_micro_batch to choose a budget)",
             train_cfg.micro_batch_size, cap, how)
    return cap

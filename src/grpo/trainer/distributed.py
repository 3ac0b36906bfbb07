"""The trainer across N processes: PyTorch FSDP2 (`fully_shard`) started by `torchrun`.

    torchrun --nproc-per-node 2 train.py mode=broadcast server.device=2 ...

Single-process runs never touch this module's collectives: everything is behind `world_size() > 1` (torchrun sets
WORLD_SIZE). The scheme, chosen for being simple and correct:

- one process group from torchrun's environment (NCCL on CUDA, gloo on CPU), one GPU per rank (LOCAL_RANK);
- the model sharded with FSDP2: every transformer block, then the root;
- rank 0 owns every output (Hydra run dir, metrics.jsonl, checkpoints, the vLLM server and the data pipeline):
  it fetches each step's groups and broadcasts them (`broadcast_object_list`); every rank builds the same
  micro-batches and takes its share (`rank_share`); ranks with fewer micro-batches run a zero-weighted one so
  every rank runs the same number of forward/backward passes (FSDP's collectives must match);
- the loss is normalised by the global token count, so the right gradient is the *sum* over ranks: FSDP2 averages
  over ranks, so each rank's loss is scaled by the world size (`loss_scale`);
- loss and metrics summed over ranks (`all_reduce_sum`), reported once by rank 0;
- weight sync: every rank joins the gathers rank 0's sync needs, rank 0 alone talks to the server. Each sync
  strategy says which gather it runs (`SyncStrategy.fsdp_gather`): mode=broadcast iterates `iter_full_params` (a
  `full_tensor()` all-gather per parameter) and sends, mode=none gathers `full_state_dict` and saves it for vLLM;
  modes without one (LoRA, shared_vllm) are refused at start-up (`grpo.config.validate.check_layout`);
- checkpoints (`CheckpointManager.save_distributed` / `load_distributed`): every rank joins the gathers of the full
  model and optimizer state, rank 0 writes the usual checkpoint; on resume rank 0 reads it and broadcasts it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from grpo.pipeline.base import DataPipeline


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def world_size() -> int:
    """Processes in this job as torchrun announced them (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    return rank() == 0


def init_from_env(device_type: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK); NCCL with one
    GPU per rank when CUDA is used, gloo on CPU. Idempotent."""
    ws, r, lr = world_size(), int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_type == "auto" else device_type == "cuda"
    if use_cuda:
        torch.cuda.set_device(lr)
        device = torch.device("cuda", lr)
    else:
        device = torch.device("cpu")
    if ws > 1 and not dist.is_initialized():
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=r, world_size=ws, **kwargs)
    return DistInfo(rank=r, world_size=ws, local_rank=lr, device=device)


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of an HF causal LM (model.model.layers for Llama / Qwen2 families)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None and hasattr(model, "get_decoder"):
        layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__} to shard")
    return list(layers)


def shard_model(model: nn.Module, mp_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: each transformer block, then the root (embeddings, final norm, head). In place; returns `model`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if mp_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # The trainer's log-probs call the decoder and the head's weight directly (never model.forward), so the
    # root's parameters (embeddings, final norm, head) would stay sharded: run them as an FSDP forward method.
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    from grpo.trainer.logprobs import token_logprobs

    model.grpo_token_logprobs = types.MethodType(lambda self, *a, **k: token_logprobs(self, *a, **k), model)
    register_fsdp_forward_method(model, "grpo_token_logprobs")
    return model


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (pickled; for a step's groups, small next to the weights)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank_share(items: Sequence[Any], rank_: int, world: int) -> tuple[list[Any], int]:
    """This rank's contiguous slice of `items` and how many zero-weighted extra passes it must run so that every
    rank runs `ceil(len/world)` passes. E.g. 5 items, 2 ranks: rank 0 gets 3, rank 1 gets 2 (+1 padding)."""
    per = -(-len(items) // world) if items else 0
    mine = list(items[rank_ * per : (rank_ + 1) * per])
    return mine, per - len(mine)


def loss_scale(world: int) -> float:
    """Factor on each rank's loss so FSDP's gradient average over ranks becomes the sum (global normalisers)."""
    return float(world)


def all_reduce_sum(values: dict[str, float], device: torch.device | None = None) -> dict[str, float]:
    """Sum of each value over ranks (keys must match on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


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


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank `dst` (None on the others); `[obj]` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def is_sharded(model: nn.Module) -> bool:
    """True when `model` holds FSDP2 (DTensor) parameters, whose full values only a collective can read."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


# ---------------------------------------------------------------- rank roles (rank 0 leads, the others follow)
class LeaderPipeline:
    """Rank 0's data pipeline: fetches each step's groups and broadcasts them to the other ranks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def next_groups(self, step: int) -> list[dict]:
        return broadcast_object(self.inner.next_groups(step))

    def __getattr__(self, name: str) -> Any:  # setup, state_dict, close, last_metrics ...
        return getattr(self.inner, name)


class FollowerPipeline(DataPipeline):
    """Ranks > 0: the groups rank 0 broadcast; no server, no rollouts of their own."""

    def setup(self, ctx: Any) -> None:
        pass

    def next_groups(self, step: int) -> list[dict]:
        return broadcast_object(None)


class FollowerSync:
    """Ranks > 0: no server; a weight sync is their share of the gathers rank 0's sync performs.

    `gather` is rank 0's strategy's `fsdp_gather`: "params" (mode=broadcast: `iter_full_params`) or "state_dict"
    (mode=none: `full_state_dict`); both sides must run the same collectives in the same order."""

    uses_lora = False
    requires_cuda = False

    def __init__(self, sync_every: int = 1, version: int = 0, gather: str = "params") -> None:
        if gather not in ("params", "state_dict"):
            raise ValueError(f"gather must be 'params' or 'state_dict', got {gather!r}")
        self.sync_every = sync_every
        self.version = version
        self.gather = gather
        self.server = None

    def launch(self, ctx: Any) -> None:
        pass

    def load_model(self, ctx: Any) -> None:
        return None

    def before_optimizer_step(self) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def check_health(self) -> bool:
        return False

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        if self.gather == "state_dict":
            full_state_dict(model)  # empty here; rank 0 gets the tensors
        else:
            drain_full_params(model)
        self.version += 1
        return {"sync/seconds": 0.0, "sync/version": float(self.version)}

    def shutdown(self) -> None:
        pass


class NullMetrics:
    """Ranks > 0 write no metrics."""

    def log(self, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass

"""The trainer across N processes: PyTorch FSDP2 (`fully_shard`) started by `torchrun`.

    torchrun --nproc-per-node 2 train.py mode=broadcast server.device=2 ...

Single-process runs never touch this module's collectives: everything is behind `world_size() > 1` (torchrun sets
WORLD_SIZE). The scheme, chosen for being simple and correct:

- one process group from torchrun's environment (NCCL on CUDA, gloo on CPU), one GPU per rank: the GPU is the
  rank's LOCAL_RANK (its index on its own node), everything else goes by the global RANK, so `torchrun --nnodes N`
  needs nothing more (docs/multi_node.md);
- the model sharded with FSDP2: every transformer block, then the root;
- global rank 0 owns every output (Hydra run dir, metrics.jsonl, checkpoints, the vLLM server and the data pipeline):
  it fetches each step's groups and broadcasts them (`broadcast_object_list`); every rank builds the same
  micro-batches and takes its share (`rank_share`); ranks with fewer micro-batches run a zero-weighted one so
  every rank runs the same number of forward/backward passes (FSDP's collectives must match);
- the loss is normalised by the global token count, so the right gradient is the *sum* over ranks: FSDP2 averages
  over ranks, so each rank's loss is scaled by the world size (`loss_scale`);
- loss and metrics summed over ranks (`all_reduce_sum`), reported once by rank 0;
- weight sync: every rank joins the gathers rank 0's sync needs, rank 0 alone talks to the server. Each sync
  strategy says which gather it runs (`SyncStrategy.fsdp_gather`): mode=broadcast iterates `iter_full_params` (a
  `full_tensor()` all-gather per parameter, grpo.weights.params) and sends, mode=none gathers `full_state_dict` and saves it for vLLM,
  the LoRA modes gather the adapter alone (`full_trainable_params`; the frozen base is never gathered); a mode
  without one (shared_vllm) is refused at start-up (`SyncStrategy.check_config`);
- checkpoints (`CheckpointManager.save_distributed` / `load_distributed`): every rank joins the gathers of the full
  model (of a LoRA model: the adapter) and optimizer state, rank 0 writes the usual checkpoint; on resume rank 0
  reads it and broadcasts it.
"""

from __future__ import annotations

import os
import socket
import types
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from grpo.trainer.layers import find_blocks
from grpo.trainer.logprobs import token_logprobs


@dataclass(frozen=True)
class DistInfo:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

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
        if lr >= torch.cuda.device_count():
            # Without this, torch's "invalid device ordinal" names neither the rank nor the host.
            raise RuntimeError(
                f"rank {r} has LOCAL_RANK={lr} but host {socket.gethostname()} sees {torch.cuda.device_count()} "
                "GPU(s): start at most that many processes on it (torchrun --nproc-per-node)")
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


def shard_model(model: nn.Module, mp_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: each transformer block, then the root (embeddings, final norm, head). In place; returns `model`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if mp_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    for block in find_blocks(model)[1]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


# The FSDP2 forward method the trainer's log-probs run through (see sharded_token_logprobs).
LOGPROBS_METHOD = "grpo_token_logprobs"


def sharded_token_logprobs(model: nn.Module) -> Callable[..., torch.Tensor]:
    """`token_logprobs(model, ...)` for a model sharded by `shard_model`, as a function of the batch alone.

    The log-probs call the decoder and the head's weight directly (never model.forward), so FSDP2's root hooks would
    leave the root's parameters (embeddings, final norm, head) sharded. FSDP2 runs its hooks around a *method* of the
    module registered with `register_fsdp_forward_method`, so the computation becomes one, bound here once."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not hasattr(model, LOGPROBS_METHOD):
        setattr(model, LOGPROBS_METHOD, types.MethodType(lambda self, *a, **k: token_logprobs(self, *a, **k), model))
        register_fsdp_forward_method(model, LOGPROBS_METHOD)
    return getattr(model, LOGPROBS_METHOD)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (pickled; for a step's groups, small next to the weights)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


T = TypeVar("T")


def rank0_result(compute: Callable[[], T]) -> T:
    """`compute()` run by rank 0 alone, its result on every rank (pickled). An exception on rank 0 is raised there
    and, as a RuntimeError carrying its message, on every other rank: no rank waits forever on a collective that
    rank 0 never reaches. Without a process group: `compute()`."""
    if not (dist.is_available() and dist.is_initialized()):
        return compute()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = compute()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks have heard of it
            error = e
    result, message = broadcast_object((result, None if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"rank 0 failed: {message}")
    return result


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
    """Sum of each value over ranks. The keys must match on every rank: checked first by a fixed-size collective,
    because all-reduces of different sizes hang under NCCL (until its watchdog aborts) instead of failing."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(values)
    keys = sorted(values)
    check_same_keys(keys, device)
    if not keys:
        return {}
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


def check_same_keys(keys: list[str], device: torch.device | None = None) -> None:
    """Raise on every rank when the ranks' sorted `keys` differ (count or names), with this rank's keys."""
    fingerprint = [float(len(keys)), float(zlib.crc32("\0".join(keys).encode()) & 0xFFFFFF)]
    t = torch.tensor(fingerprint + [-v for v in fingerprint], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0] != -t[2] or t[1] != -t[3]:
        raise RuntimeError(f"rank {dist.get_rank()}: the ranks would sum different metrics (a collective mismatch); "
                           f"this rank has {keys}")


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank `dst` (None on the others); `[obj]` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out

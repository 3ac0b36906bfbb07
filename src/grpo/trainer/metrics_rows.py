"""The loop's metrics rows beside the loss: the device's memory peak and the process's size, the throughput and MFU of
an update's forwards (`grpo.trainer.flops`), and the bookkeeping that turns a rollout batch's update rows into its
metrics rows (the batch's data metrics on the first, the sync's and the batch summary on the last, step times that
add up to the batch's wall time)."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from grpo.trainer.flops import ModelFlops, pad_fraction, peak_tflops, perf_metrics
from grpo.trainer.prefix import shared_row_lengths
from grpo.trainer.train_batch import PreparedBatch


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is in KiB on Linux


def process_stats() -> dict[str, float]:
    """Current RSS and open file descriptors of this process (Linux /proc; empty elsewhere), for leak watching."""
    try:
        rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        return {}
    return {"memory/rss_gb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 1024**3, "proc/open_fds": float(fds)}


def model_flops(model: torch.nn.Module) -> Optional[ModelFlops]:
    """The FLOP counter of `model`'s config; None for a model whose config lacks the shapes (no perf/ metrics)."""
    try:
        return ModelFlops.from_config(model.config)
    except (AttributeError, TypeError, ValueError):
        return None


def device_peak(model: torch.nn.Module, device: torch.device) -> Optional[float]:
    """Dense peak TFLOPS of `device` for the dtype `model` trains in; None on CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    dtype = next(model.parameters()).dtype
    return peak_tflops(torch.cuda.get_device_name(device), dtype in (torch.bfloat16, torch.float16))


def forward_perf(batch: PreparedBatch, seconds: float, *, packed: bool, shared: bool, flops: Optional[ModelFlops],
                 peak: Optional[float], recompute: bool, world_size: int) -> dict[str, float]:
    """`batch/pad_fraction` and `tokens/forwarded` of an update's forward passes (the shared rows' under prefix
    sharing), and `perf/tflops` / `perf/mfu` of its model FLOPs over `seconds`, per device (the `world_size` ranks
    share the FLOPs); `recompute`: gradient checkpointing runs each forward twice."""
    if shared:  # the rows actually forwarded: each prompt once (padded to the micro-batch's longest row)
        lengths = [shared_row_lengths(mb.attention_mask, mb.labels, mb.input_ids) for mb in batch.micro_batches]
    else:
        lengths = [mb.attention_mask.sum(dim=1).tolist() for mb in batch.micro_batches]
    out = {"batch/pad_fraction": pad_fraction(lengths, packed and not shared),
           "batch/micro_batches": float(len(lengths)),
           # Real tokens the decoder ran, padding excluded (each sequence's last token is never an input).
           "tokens/forwarded": float(sum(sum(lens) for lens in lengths))}
    if flops is None:
        return out
    total = flops.train_flops([n for lens in lengths for n in lens], batch.num_loss_tokens, recompute)
    return {**out, **perf_metrics(total / world_size, seconds, peak)}


def batch_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per rollout batch, over its updates: how much the clip acted and how far the policy moved from pi_old."""
    def values(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) is not None]

    out = {"batch/updates": float(len(rows))}
    for key, agg in (("grpo/clipped_fraction", "mean"), ("grpo/approx_kl_old", "max"), ("grpo/ratio_old_max", "max")):
        v = values(key)
        if v:
            out[f"batch/{key.split('/')[1]}_{agg}"] = sum(v) / len(v) if agg == "mean" else max(v)
    return out


@dataclass(frozen=True)
class BatchTimes:
    """`time.perf_counter()` at the phases of a rollout batch: started, data fetched, updates done (the sync
    starts), sync done."""

    start: float
    data: float
    sync: float
    end: float


def fill_batch_rows(rows: list[dict[str, Any]], head: dict[str, Any], times: BatchTimes,
                    sync_metrics: dict[str, float], weight_version: int,
                    server_metrics: Callable[[], dict[str, float]], device: torch.device) -> None:
    """The update rows of one rollout batch (one per optimizer step, in order) made its metrics rows, in place: the
    batch's data metrics (`head`) on the first, the sync's and the batch summary on the last, the memory, the
    server's counters and the process's size on each."""
    rows[0] = {"step": rows[0]["step"], **head, **rows[0]}
    rows[0]["time/data_seconds"] = times.data - times.start
    # Step times add up to the batch's wall time: fetch (and pi_old) count on the first update, sync on the last.
    rows[0]["time/step_seconds"] += times.sync - times.start - sum(r["time/step_seconds"] for r in rows)
    rows[-1]["time/step_seconds"] += times.end - times.sync
    rows[-1].update(batch_summary(rows))
    for row in rows:
        row.update(sync_metrics if row is rows[-1] else
                   {"sync/seconds": 0.0, "sync/version": float(weight_version),
                    "sync/gen_stall_seconds": 0.0, "sync/drain_seconds": 0.0})
        row["memory/peak_gb"] = peak_memory_gb(device)
        # Restarts so far in this session (a restart in an eval: next row); with replicas, each one's requests.
        row.update(server_metrics())
        row.update(process_stats())

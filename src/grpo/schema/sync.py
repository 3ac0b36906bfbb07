"""Schemas of the mode group: one per weight-sync mode, its fields the sync strategy's kwargs."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional


class WeightReceive(StrEnum):
    """``mode.receive`` of mode=broadcast: how vLLM's workers take in the trainer's buckets."""

    # vLLM's weight-transfer engine: a weight-update session with layer-wise reload (start, a call per bucket,
    # finish); takes any model vLLM loads, quantized ones included.
    engine = "engine"
    # Each worker receives the buckets into a buffer it keeps and hands them to the model's load_weights, which
    # copies them into the served tensors (TRL's and verl's workers do the same); unquantized models only.
    direct = "direct"


@dataclass
class CheckpointRestartSyncConfig:
    """mode=none: full checkpoint, then vLLM reloads the new weights."""

    _target_: str = "grpo.sync.save_and_reload.SaveAndReloadSync"
    # Push weights to vLLM every N optimizer steps (rollouts in between use the previous weights).
    sync_every: int = 1
    # inplace: vLLM reloads the saved weights in place (a restart only when that fails); restart: restart vLLM on them
    # every sync (what the Atropos example trainer does; slower); background: inplace, run on a thread of its own while
    # the trainer goes on with the next batch (with train.max_staleness >= 1; generation waits until it has landed).
    reload: str = "inplace"


@dataclass
class LoraRestartSyncConfig:
    """mode=lora_restart: save the adapter, restart vLLM with it preloaded."""

    _target_: str = "grpo.sync.lora_restart.LoraRestartSync"
    # Push weights to vLLM every N optimizer steps (rollouts in between use the previous weights).
    sync_every: int = 1


@dataclass
class LoraHotSwapSyncConfig:
    """mode=lora_only: hot-swap the adapter through vLLM's LoRA endpoints."""

    _target_: str = "grpo.sync.lora_hotswap.LoraHotSwapSync"
    # Push weights to vLLM every N optimizer steps (rollouts in between use the previous weights).
    sync_every: int = 1
    # The adapters' served names are <adapter_prefix>-v<version>.
    adapter_prefix: str = "policy"
    # The server (server.external_url) serves other jobs' adapters too (LoRA configurations at once, docs/sweeps.md):
    # each adapter reports its own weight version, and the job unloads its adapters when it ends.
    shared_server: bool = False


@dataclass
class SharedMemorySyncConfig:
    """mode=shared_vllm: train views of vLLM's own tensors (CUDA IPC on a GPU, a shared file mapping on the CPU)."""

    _target_: str = "grpo.sync.shared_memory.SharedMemorySync"
    # Advance the served weight version (and reset vLLM's prefix cache) every N optimizer steps. The weights themselves
    # change at every optimizer step: vLLM computes with the trainer's tensors.
    sync_every: int = 1
    # false: vLLM's generation pauses around each optimizer step (a round trip to the server before and after it), so no
    # forward pass reads half-updated weights, and each sync drops vLLM's prefix cache (running requests recompute their
    # KV on the new weights), so every token after a sync is sampled from the new weights. true (in-flight weight
    # updates, as PipelineRL): generation goes on through the optimizer step and keeps its KV cache; a rollout may be
    # sampled from a mix of older and newer weights, and its log-probs are those it was sampled with, so a PPO ratio
    # against them (loss.old_logprobs=rollout) stays exact. The trainer skips two calls per step and the server
    # recomputes nothing. Refused with data.rollout_logprobs=false, whose rollouts must be on-policy.
    in_flight_updates: bool = False


@dataclass
class NCCLBroadcastSyncConfig:
    """mode=broadcast: trainer and vLLM on different GPUs; NCCL broadcast through vLLM's weight-transfer engine."""

    _target_: str = "grpo.sync.nccl_broadcast.NCCLBroadcastSync"
    # Push weights to vLLM every N optimizer steps (rollouts in between use the previous weights).
    sync_every: int = 1
    # Largest packed bucket in MiB; a tensor bigger than this travels in a bucket of its own.
    bucket_mb: float = 512.0
    # Buckets in flight on the trainer at once (extra trainer memory: num_buffers x bucket_mb).
    num_buffers: int = 2
    # Cast weights to this dtype before sending (e.g. bfloat16); null = the trainer's dtype.
    transfer_dtype: Optional[str] = None
    # Rendezvous of the trainer-vLLM NCCL group (the trainer hosts it); null port = a free one.
    master_address: str = "127.0.0.1"
    # Port of that rendezvous; null picks a free one.
    master_port: Optional[int] = None
    # Seconds to wait for the group to form or for one transfer to finish.
    timeout_s: float = 600.0
    # How vLLM's workers take the buckets: engine = vLLM's weight-transfer engine (a layer-wise reload session per sync;
    # any model vLLM loads, quantized included); direct = each worker receives into a buffer it keeps and calls the
    # model's load_weights (no reload session, no buffers allocated per sync; unquantized models).
    receive: WeightReceive = WeightReceive.engine

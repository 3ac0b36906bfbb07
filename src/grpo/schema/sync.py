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
    sync_every: int = 1
    # inplace: vLLM reloads the saved weights in place (a restart when that fails); restart: always restart vLLM;
    # background: inplace on a thread of its own, the trainer going on meanwhile (generation waits for it).
    reload: str = "inplace"


@dataclass
class LoraRestartSyncConfig:
    """mode=lora_restart: save the adapter, restart vLLM with it preloaded."""

    _target_: str = "grpo.sync.lora_restart.LoraRestartSync"
    sync_every: int = 1


@dataclass
class LoraHotSwapSyncConfig:
    """mode=lora_only: hot-swap the adapter through vLLM's LoRA endpoints."""

    _target_: str = "grpo.sync.lora_hotswap.LoraHotSwapSync"
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
    sync_every: int = 1
    # Weights change under running generation: no pause around the optimizer step, no prefix-cache reset at the
    # sync; a rollout may then be sampled from a mix of weights, its log-probs still the ones it was sampled with.
    in_flight_updates: bool = False


@dataclass
class NCCLBroadcastSyncConfig:
    """mode=broadcast: trainer and vLLM on different GPUs; NCCL broadcast through vLLM's weight-transfer engine."""

    _target_: str = "grpo.sync.nccl_broadcast.NCCLBroadcastSync"
    sync_every: int = 1
    # Largest packed bucket in MiB (a bigger tensor travels alone).
    bucket_mb: float = 512.0
    # Buckets in flight on the trainer at once (memory: num_buffers x bucket_mb).
    num_buffers: int = 2
    # Cast weights to this dtype before sending (e.g. bfloat16); null = the trainer's dtype.
    transfer_dtype: Optional[str] = None
    # Rendezvous of the trainer-vLLM NCCL group (the trainer hosts it); null port = a free one.
    master_address: str = "127.0.0.1"
    master_port: Optional[int] = None
    # Longest wait for the group to form or one transfer to finish.
    timeout_s: float = 600.0
    # How vLLM's workers take the buckets: engine (vLLM's weight-transfer engine) or direct (load_weights from a kept
    # buffer: no per-sync reload lifecycle or buffer allocation; unquantized models).
    receive: WeightReceive = WeightReceive.engine

"""mode=broadcast: trainer and vLLM on different GPUs; weights pushed by NCCL broadcast after each optimizer step.

Built on vLLM's own weight-transfer engine (``--weight-transfer-config {"backend": "nccl"}``), present in vLLM
0.26 and 0.32:

1. launch: the server starts with the NCCL engine; the trainer (NCCL rank 0, on its own GPU) and every vLLM
   worker of every replica (ranks 1.., replica after replica: `transfer_ranks`) join one group: `POST /grpo/weight_transfer/init` runs vLLM's `init_weight_transfer_engine`
   on the workers while the trainer joins with vLLM's `trainer_init` (same rendezvous, same PyNccl code).
2. sync: the trainer's parameters, under their Hugging Face names, unfused (vLLM's `load_weights` fuses q/k/v and
   gate/up and shards for tensor parallelism itself), are packed into flat buckets of at most `bucket_mb`
   (`grpo.sync.buckets`); generation is paused, `POST /grpo/weight_transfer/update` runs one vLLM weight-update
   session with one `update_weights` call per bucket while the trainer broadcasts the buckets in the same order,
   then the prefix cache is reset, the version bumped and generation resumed. With several replicas every one is
   paused and runs its session at once: the trainer's one broadcast per bucket reaches all their workers.

Works with vLLM tensor parallelism (every rank receives the full tensors and keeps its shard) and with an FSDP2
trainer (each parameter is gathered with `full_tensor()`; all trainer ranks iterate, rank 0 sends).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn

from grpo.config_values import ConfigError, option
from grpo.inference.launch_args import gpus_per_server
from grpo.inference.weight_transfer import UPDATE_PHASES
from grpo.schema import NCCLBroadcastSyncConfig
from grpo.serving.server import Replica, external_urls
from grpo.serving.session import ServerLaunch
from grpo.sync.base import SyncContext, SyncStrategy
from grpo.sync.buckets import Bucket, pack_bucket, plan_buckets
from grpo.sync.param_mapping import FUSED_PROJECTIONS, MappingError, normalize_vllm_name, plan_mapping
from grpo.weights.params import iter_full_params

log = logging.getLogger(__name__)

WEIGHT_TRANSFER_FLAG = "--weight-transfer-config"
WEIGHT_TRANSFER_CONFIG = '{"backend": "nccl"}'
# Prefixes wrappers put in front of the Hugging Face names (torch.compile, DDP, FSDP1, activation checkpointing).
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def hf_weight_name(name: str) -> str:
    """The Hugging Face parameter name vLLM's `load_weights` expects, without wrapper prefixes."""
    parts = [p for p in name.split(".") if p + "." not in _WRAPPER_PREFIXES]
    return ".".join(parts)


def weight_specs(model: nn.Module, transfer_dtype: torch.dtype | None = None) -> list[tuple[str, torch.dtype, tuple]]:
    """(HF name, dtype sent, global shape) of every parameter, in `named_parameters` order (tied ones once)."""
    specs = []
    for name, p in model.named_parameters():
        if ".lora_" in name or name.startswith("base_model.model."):
            raise ValueError(f"mode=broadcast sends full weights; {name} looks like a LoRA/PEFT parameter")
        specs.append((hf_weight_name(name), transfer_dtype or p.dtype, tuple(p.shape)))
    return specs


def check_against_vllm(specs: list[tuple[str, Any, tuple]], vllm_params: list[dict], config: Any) -> None:
    """Every HF name must land on vLLM's (fused) parameters and cover all of them (shapes checked when vLLM runs
    one worker; with tensor parallelism only the names). Raises MappingError naming each problem."""
    plan_mapping({n: s for n, _, s in specs}, {p["name"]: tuple(p["shape"]) for p in vllm_params}, config)


def transfer_ranks(workers_per_replica: list[int]) -> tuple[int, list[int]]:
    """The one NCCL group of a sync to several replicas: its size (the trainer, rank 0, and every worker) and each
    replica's first rank (its `rank_offset`), replica after replica."""
    offsets, rank = [], 1
    for workers in workers_per_replica:
        offsets.append(rank)
        rank += workers
    return rank, offsets


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Call(threading.Thread):
    """An HTTP call that blocks until the trainer's side of a collective runs; result or error on join."""

    def __init__(self, fn, *args) -> None:
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = e

    def get(self, timeout: float | None = None) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"server did not finish {getattr(self.fn, '__name__', self.fn)} within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


class NCCLBroadcastSync(SyncStrategy):
    """Push full weights into a vLLM server on another GPU through vLLM's NCCL weight-transfer engine."""

    mode_name = "broadcast"
    uses_lora = False
    fsdp_gather = "params"
    # mode.receive=engine: vLLM's layer-wise reload quantizes the received weights anew (direct: refused below).
    quantization_refusal = None

    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1,
                     local_world_size: int | None = None) -> None:
        """CUDA, and vLLM on GPUs the trainer's ranks do not use (NCCL cannot join two ranks on one GPU)."""
        if not cuda:
            raise ConfigError(
                "mode=broadcast sends weights by NCCL from the trainer's GPU to vLLM's GPU(s) and needs CUDA; none "
                "is visible here. Use mode=none, mode=lora_only or mode=lora_restart on this machine."
            )
        extra = [str(a).split("=", 1)[0] for a in (option(cfg.server, "extra_args", None) or [])]
        quantized = option(cfg.server, "quantization", None) is not None or "--quantization" in extra or "-q" in extra
        if str(option(cfg.mode, "receive", NCCLBroadcastSyncConfig.receive)) == "direct" and quantized:
            raise ConfigError(
                "mode.receive=direct loads the trainer's tensors with the model's load_weights, without the "
                "post-load processing a quantized server needs; use mode.receive=engine with server.quantization "
                "(or --quantization)"
            )
        # The trainer's ranks on vLLM's host take GPUs 0..k-1 there (across nodes fewer than world_size); vLLM's GPUs
        # must come after them.
        local_gpus = world_size if local_world_size is None else local_world_size
        span = gpus_per_server(option(cfg.server, "extra_args", None))  # tensor parallel k: k GPUs per server
        if external_urls(cfg.server):
            pass  # the servers run elsewhere, on GPUs of their own
        elif option(cfg.server, "devices"):
            firsts = list(cfg.server.devices)
            gpus = [g for first in firsts for g in range(first, first + span)]
            if min(gpus) < local_gpus or len(set(gpus)) != len(gpus):
                raise ConfigError(
                    f"mode=broadcast needs each vLLM replica on GPUs of its own that the trainer does not use (NCCL "
                    f"cannot join two ranks on one GPU): server.devices={firsts} (each the first of {span} GPU(s)) "
                    f"must give distinct GPUs >= {local_gpus}, e.g. server.devices="
                    f"[{', '.join(str(local_gpus + i * span) for i in range(len(firsts)))}]"
                )
        else:
            dev = cfg.server.device
            if dev is None or (isinstance(dev, int) and dev < local_gpus):
                raise ConfigError(
                    f"mode=broadcast needs vLLM on GPUs the trainer does not use (NCCL cannot join two ranks on one "
                    f"GPU): set server.device to a GPU index >= {local_gpus} (server.device={dev}); e.g. trainer on "
                    f"GPU 0, server.device=1"
                )
        super().check_config(cfg, cuda=cuda, world_size=world_size, local_world_size=local_world_size)  # FSDP2: every rank iterates the parameters, rank 0 sends each as it is gathered

    def __init__(self, sync_every: int = NCCLBroadcastSyncConfig.sync_every,
                 bucket_mb: float = NCCLBroadcastSyncConfig.bucket_mb,
                 num_buffers: int = NCCLBroadcastSyncConfig.num_buffers, transfer_dtype: str | None = None,
                 master_address: str = NCCLBroadcastSyncConfig.master_address, master_port: int | None = None,
                 timeout_s: float = NCCLBroadcastSyncConfig.timeout_s, receive: str = "engine") -> None:
        super().__init__(sync_every)
        if bucket_mb <= 0 or num_buffers < 1:
            raise ValueError("mode.bucket_mb must be > 0 and mode.num_buffers >= 1")
        self.receive = str(receive)  # how vLLM's workers take the buckets (grpo.schema.sync.WeightReceive)
        self.bucket_bytes = int(bucket_mb * 1024**2)
        self.num_buffers = int(num_buffers)
        self.transfer_dtype = getattr(torch, transfer_dtype) if transfer_dtype else None
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        self.group = None  # vLLM PyNcclCommunicator, trainer = rank 0
        self.world_size = 0
        self.device: torch.device | None = None
        self._stream: torch.cuda.Stream | None = None
        self._checked = False

    # ------------------------------------------------------------------ launch
    def server_launch(self, ctx: SyncContext) -> ServerLaunch:
        if not torch.cuda.is_available():
            raise RuntimeError("mode=broadcast sends weights by NCCL between GPUs and needs CUDA; use mode=none here")
        # The server needs vLLM's NCCL weight-transfer engine: add the flag unless the user already set it.
        extra = [str(a) for a in (option(ctx.server_cfg, "extra_args", None) or [])]
        engine = [] if any(a.split("=", 1)[0] == WEIGHT_TRANSFER_FLAG for a in extra) else [
            WEIGHT_TRANSFER_FLAG, WEIGHT_TRANSFER_CONFIG]
        return ServerLaunch(Path(ctx.resume_weights or ctx.model_dir), extra_args=tuple(engine))

    def serve_initial_weights(self) -> None:
        """An attached server loads a resumed checkpoint; then the trainer and the server's workers join one NCCL
        group."""
        self.device = torch.device("cuda", torch.cuda.current_device())
        resume = self.ctx.resume_weights
        if self.server.external and resume:
            self.server.each(lambda replica: replica.client.reload_weights(str(resume), version=self.version))
        self._init_group()

    def _init_group(self) -> None:
        """The trainer and every worker of every replica join one NCCL group (mode.master_address: where the workers
        reach the trainer's rendezvous, an address of the trainer's host that they can reach)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        workers = self.server.each(lambda replica: replica.client.rpc("grpo_param_info"))
        self._vllm_params = workers[0][0]
        self._workers_per_replica = [len(w) for w in workers]
        self.world_size, offsets = transfer_ranks(self._workers_per_replica)
        port = self.master_port or _free_port(self.master_address)
        t0 = time.perf_counter()
        calls = [
            _Call(replica.client.weight_transfer_init, {
                "master_address": self.master_address, "master_port": port, "world_size": self.world_size,
                "rank_offset": offset, "bucket_bytes": self.bucket_bytes, "num_buffers": self.num_buffers,
            }, self.timeout_s)
            for replica, offset in zip(self.server.replicas, offsets)
        ]
        torch.cuda.set_device(self.device)
        self.group = trainer_init({"master_address": self.master_address, "master_port": port,
                                   "world_size": self.world_size})
        for call in calls:
            call.get(self.timeout_s)
        self._stream = torch.cuda.Stream(self.device)
        log.info("NCCL weight-transfer group up: trainer + %d vLLM worker(s) of %d replica(s), %.2f s",
                 self.world_size - 1, len(calls), time.perf_counter() - t0)

    def restore_replica(self, replica: Replica) -> None:
        # A restarted server has a fresh engine: push the current weights again after it joins a new group.
        raise RuntimeError(
            "mode=broadcast cannot restart a dead vLLM server mid-run (its NCCL group with the trainer is gone); "
            "resume the run with train.resume=<run dir>"
        )

    # ------------------------------------------------------------------ sync
    def plan(self, model: nn.Module) -> list[Bucket]:
        return plan_buckets(weight_specs(model, self.transfer_dtype), self.bucket_bytes)

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        return self.send(model, iter_full_params(model), step)

    def send(self, model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], step: int) -> dict[str, float]:
        """Broadcast `named` (full tensors, `model`'s parameter order) into vLLM; returns the sync metrics."""
        t0 = time.perf_counter()
        buckets = self.plan(model)
        if not self._checked:
            self._check_names(model)
        version = self.version + 1
        body = {"buckets": [b.update_info() for b in buckets], "bucket_bytes": self.bucket_bytes,
                "num_buffers": self.num_buffers, "weight_version": version, "receive": self.receive}
        # Generation stalls for the transfer only: paused ("keep": requests in flight freeze, then go on).
        with self.stalling():
            self.server.each(lambda replica: replica.client.pause())
            t_paused = time.perf_counter()
            try:
                calls = [_Call(replica.client.weight_transfer_update, body, self.timeout_s)
                         for replica in self.server.replicas]
                self._broadcast(buckets, named)
                answers = [call.get(self.timeout_s) for call in calls]
            finally:
                self.server.each(lambda replica: replica.client.resume())
        self.version = version
        t1 = time.perf_counter()
        return {
            "sync/seconds": t1 - t0,
            "sync/paused_seconds": t1 - t_paused,
            "sync/server_seconds": max(float(answer.get("seconds", 0.0)) for answer in answers),
            # Where the server's time goes, phase by phase (a small model's sync is mostly not the transfer:
            # bench/gpu/README.md, the section of `lease8`): the slowest replica's seconds per phase.
            **{f"sync/server_{phase}_seconds": max(float(answer.get("phases", {}).get(phase, 0.0)) for answer in answers)
               for phase in UPDATE_PHASES},
            "sync/bytes": float(sum(b.nbytes for b in buckets)),
            "sync/buckets": float(len(buckets)),
            "sync/version": float(version),
        }

    def _broadcast(self, buckets: list[Bucket], named: Iterable[tuple[str, torch.Tensor]]) -> None:
        it = iter(named)
        stream = self._stream
        pending: deque = deque()
        for bucket in buckets:
            tensors = []
            for meta in bucket.metas:
                name, t = next(it)
                if hf_weight_name(name) != meta.name:
                    raise RuntimeError(f"parameter order changed: got {name}, planned {meta.name}")
                tensors.append(t)
            # Tensors gathered just now (FSDP full_tensor) come from the default stream.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                buf = pack_bucket(bucket, tensors, device=self.device)
                self.group.broadcast(buf, src=0, stream=stream)
                ev = torch.cuda.Event()
                ev.record(stream)
            pending.append((ev, buf, tensors))
            while len(pending) >= self.num_buffers:  # bound the buffers in flight
                pending.popleft()[0].synchronize()
        rest = next(it, None)
        if rest is not None:
            raise RuntimeError(f"parameter {rest[0]} was not planned")
        stream.synchronize()

    def _check_names(self, model: nn.Module) -> None:
        """Before the first transfer: every HF name maps onto vLLM's parameters (fail loudly, never drop)."""
        specs = weight_specs(model)
        if max(self._workers_per_replica) == 1:  # no tensor parallelism: the shapes are whole
            check_against_vllm(specs, self._vllm_params, model.config)
        else:
            missing = [n for n, _, _ in specs if not _maps_by_name(n, {p["name"] for p in self._vllm_params})]
            if missing:
                raise MappingError(f"HF parameters with no vLLM counterpart: {missing}")
        self._checked = True

    def detach(self) -> bool:
        self.group = None
        return True


def _maps_by_name(hf_name: str, vllm_names: set[str]) -> bool:
    """Name-only check (tensor parallel: shapes are sharded): the HF name or its fused target exists in vLLM."""
    names = {normalize_vllm_name(n) for n in vllm_names}
    module, _, leaf = hf_name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj in FUSED_PROJECTIONS:
        return f"{parent}.{FUSED_PROJECTIONS[proj][0]}.{leaf}" in names
    return hf_name in names or hf_name == "lm_head.weight"

"""mode=shared_vllm: one copy of the weights, trained in place inside vLLM's own memory.

The trainer builds the Hugging Face model with each parameter a view into the served model's tensors, fused
`qkv_proj` / `gate_up_proj` included (`grpo.sync.param_mapping`). Every HF parameter must be mapped; an unmapped one
is an error, never zero-filled. Optimizer steps write in place, so a sync only bumps the version; generation is
paused around the optimizer step so no forward pass reads half-updated weights. How the memory is shared:

- CUDA: the server's worker extension exports CUDA IPC handles of every parameter; the trainer rebuilds those
  tensors (`torch.multiprocessing.reductions.rebuild_cuda_tensor`).
- CPU (vLLM's CPU backend): the worker moves every parameter into one file mapping (`/dev/shm`, shared pages) that
  the trainer maps too. vLLM's CPU GEMMs normally multiply with copies packed at load time; the server is started
  with plain GEMMs on the parameters themselves (grpo.inference.vllm_plugin, `GRPO_VLLM_CPU_PLAIN_GEMM`). The file
  outlives a crashed server, so a restarted one adopts it and serves the trained weights.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import pickle
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from grpo.config_values import ConfigError
from grpo.inference import vllm_plugin
from grpo.inference.launch_args import parallel_sizes
from grpo.schema.sync import SharedMemorySyncConfig
from grpo.serving.server import Replica, replica_count
from grpo.serving.session import ServerLaunch
from grpo.sync.base import SyncContext, SyncStrategy
from grpo.sync.param_mapping import MappingError, build_views, plan_mapping

log = logging.getLogger(__name__)

# Where the CPU weights' file mapping lives: shared memory pages, never written back to a disk.
SHARED_MEMORY_DIR = Path("/dev/shm")


def rebuild_meta_buffer_modules(model: nn.Module, config: Any, device: torch.device) -> None:
    """Rebuild on `device` the modules of a meta-built model whose buffers are still on meta (the rotary
    embedding's non-persistent inv_freq: vLLM's tensors hold no such buffer to view)."""
    for mod_name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, child = mod_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device(device):  # not a `device=` argument: transformers deprecates it for these modules
                setattr(parent, child, type(module)(config=config))


# The mapping's file name: the trainer's pid first, so a file whose trainer is gone can be recognised.
SHARED_FILE_PREFIX = "grpo-shared-weights-"


def remove_orphaned_shared_files(directory: Path) -> list[Path]:
    """Delete the weight files of shared_vllm runs whose trainer process no longer exists (a trainer killed with
    SIGKILL never reaches its shutdown, and a file in /dev/shm holds memory until deleted). Returns those deleted."""
    removed = []
    for path in directory.glob(f"{SHARED_FILE_PREFIX}*.bin"):
        pid = path.name.removeprefix(SHARED_FILE_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def map_shared_file(info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors a worker's `grpo_share_cpu_params` laid out in its file, mapped shared into this process."""
    flat = torch.from_file(info["path"], shared=True, size=info["size"], dtype=torch.uint8)
    tensors = {}
    for name, entry in info["params"].items():
        dtype = getattr(torch, entry["dtype"])
        nbytes = math.prod(entry["shape"]) * dtype.itemsize
        tensors[name] = flat[entry["offset"] : entry["offset"] + nbytes].view(dtype).view(entry["shape"])
    return tensors


class SharedMemorySync(SyncStrategy):
    """Train views of vLLM's parameters (same host; CUDA IPC or a shared CPU file mapping); sync = version bump +
    prefix-cache reset."""

    mode_name = "shared_vllm"
    uses_lora = False
    # A sweep's next job reloads the initial weights into the server's tensors (in place: the same memory) and maps
    # them anew: on the CPU the file mapping, on a GPU the CUDA IPC handles (torch closes the previous job's handles
    # once its views are gone, and re-opens them for the next trainer).
    reuses_server = True
    fsdp_refusal = "shared_vllm trains vLLM's own tensors in place, which FSDP2 cannot shard"
    quantization_refusal = ("shared_vllm trains vLLM's own tensors in place, and the trainer cannot train weights vLLM "
                            "holds in FP8")
    serves_weights_in_place = True  # each optimizer step changes what the server samples

    def __init__(self, sync_every: int = SharedMemorySyncConfig.sync_every,
                 in_flight_updates: bool = SharedMemorySyncConfig.in_flight_updates) -> None:
        super().__init__(sync_every)
        # mode.in_flight_updates: weights change under running generation (no pause, no prefix-cache reset).
        self.in_flight_updates = in_flight_updates
        # CPU: the file mapping that holds the weights (the trainer's and the server's); None on CUDA.
        self.shared_file: Path | None = None

    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1,
                     local_world_size: int | None = None) -> None:
        """One vLLM worker (no tensor/pipeline/data parallelism): the trainer trains views of its tensors."""
        replicas = replica_count(cfg.server)
        if replicas > 1:
            raise ConfigError(
                f"mode=shared_vllm trains the tensors of one vLLM server in place, so it cannot serve {replicas} "
                "replicas (server.replicas / server.external_urls): each would hold weights of its own that the "
                "trainer does not train. Use mode=none or mode=lora_only (every replica reloads each sync) or "
                "mode=broadcast on GPUs, or server.replicas=1 to keep mode=shared_vllm."
            )
        sizes = parallel_sizes(cfg.server.extra_args)
        if any(v > 1 for v in sizes.values()):
            what = ", ".join(f"{k} parallel {v}" for k, v in sizes.items() if v > 1)
            raise ConfigError(
                f"mode=shared_vllm trains views of one vLLM worker's tensors and does not support vLLM {what} "
                f"(server.extra_args={list(cfg.server.extra_args)}): each rank would hold only a shard. Use "
                "mode=broadcast (trainer on its own GPU, weights sent to every vLLM rank by NCCL; set server.device) "
                "or drop --tensor-parallel-size (tp=1) to keep mode=shared_vllm."
            )
        super().check_config(cfg, cuda=cuda, world_size=world_size, local_world_size=local_world_size)

    def server_launch(self, ctx: SyncContext) -> ServerLaunch:
        # Resuming: vLLM loads the checkpoint, so the shared copy starts from the trained weights. vLLM's CPU backend
        # must multiply with the parameters the trainer writes, not copies packed at load time (CUDA kernels read the
        # parameters anyway: the variable changes nothing there).
        return ServerLaunch(Path(ctx.resume_weights or ctx.model_dir), env={vllm_plugin.PLAIN_GEMM_ENV: "1"})

    def load_model(self, ctx: SyncContext) -> nn.Module:
        """The HF model whose parameters are views into the server's tensors."""
        from transformers import AutoConfig, AutoModelForCausalLM

        infos = self.server.client.rpc("grpo_param_info")
        if len(infos) != 1:
            raise RuntimeError(f"shared_vllm supports one vLLM worker (tensor parallel 1), got {len(infos)}")
        devices = {p["device"].split(":")[0] for p in infos[0]}
        vllm_tensors = self._share_cpu_params(infos[0]) if devices == {"cpu"} else self._open_cuda_params()
        config = AutoConfig.from_pretrained(ctx.model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        hf_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        plan = plan_mapping(hf_shapes, {n: tuple(t.shape) for n, t in vllm_tensors.items()}, config)
        views = build_views(plan, vllm_tensors)
        for name, view in views.items():
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, leaf, nn.Parameter(view, requires_grad=True))
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        rebuild_meta_buffer_modules(model, config, next(iter(views.values())).device)
        leftover = [n for n, p in model.named_parameters() if p.is_meta] + [
            n for n, b in model.named_buffers() if b.is_meta
        ]
        if leftover:
            raise MappingError(f"unmapped tensors left on the meta device: {leftover}")
        return model

    def _open_cuda_params(self) -> dict[str, torch.Tensor]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        handles = pickle.loads(base64.b64decode(self.server.client.rpc("grpo_export_ipc_handles")[0]))
        return {name: rebuild_cuda_tensor(*h["args"]) for name, h in handles.items()}

    def _share_cpu_params(self, param_info: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Have the server move its parameters into a new shared file mapping; map it here too."""
        directory = SHARED_MEMORY_DIR if SHARED_MEMORY_DIR.is_dir() else Path(self.ctx.run_dir)
        needed = sum(math.prod(p["shape"]) * getattr(torch, p["dtype"]).itemsize + 64 for p in param_info)
        free = shutil.disk_usage(directory).free
        if free < needed:
            raise RuntimeError(
                f"mode=shared_vllm on the CPU keeps the weights in {directory} ({needed / 2**30:.2f} GiB needed, "
                f"{free / 2**30:.2f} GiB free there): enlarge it (a container: --shm-size) or use mode=none"
            )
        for orphan in remove_orphaned_shared_files(directory):
            log.info("shared_vllm: removed %s, left by a run whose trainer is gone", orphan)
        path = directory / f"{SHARED_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        self.shared_file = path
        info = self.server.client.rpc("grpo_share_cpu_params", path=str(path), create=True)[0]
        log.info("shared_vllm: %.1f MiB of weights shared with vLLM's CPU worker through %s", info["size"] / 2**20,
                 path)
        return map_shared_file(info)

    def restore_replica(self, replica: Replica) -> None:
        if self.shared_file is None:
            raise RuntimeError(
                "mode=shared_vllm on a GPU trains the server's own CUDA memory, which went with the dead server; "
                "resume the run from its last checkpoint with train.resume=<run dir>"
            )
        # The file mapping outlived the server: the new one loads the initial weights, then adopts the file, which
        # holds the trained ones. No rollout may reach it in between.
        with self.server.gate.held():
            super().restore_replica(replica)
            replica.client.rpc("grpo_share_cpu_params", path=str(self.shared_file), create=False)
            replica.client.set_weight_version(self.version, reset_prefix_cache=True)

    def detach(self) -> bool:
        if self.shared_file is not None:
            # Only the name goes: the pages stay while the server and the trainer's views map them (a server kept
            # for a sweep's next job keeps its copy; that job maps a file of its own).
            self.shared_file.unlink(missing_ok=True)
        return True

    def before_optimizer_step(self) -> None:
        # "keep": in-flight requests freeze (not aborted) and continue after resume. Generation stalls for the
        # optimizer step only (timed into sync/gen_stall_seconds).
        if not self.in_flight_updates:
            self._paused_at = time.perf_counter()
            self.server.client.pause()

    def after_optimizer_step(self) -> None:
        if self.in_flight_updates:
            return
        try:
            if self.shared_file is None:
                torch.cuda.synchronize()  # the writes must land before vLLM reads again
            self.server.client.resume()
        finally:
            self.record_stall(time.perf_counter() - self._paused_at)

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.shared_file is None:
            torch.cuda.synchronize()
        self.version += 1
        if self.in_flight_updates:
            # Running requests and cached KV stay; the version labels the rollouts that start from now on.
            self.server.client.set_weight_version(self.version)
        else:
            # KV blocks cached from older weights must not be reused (running requests are preempted and recomputed
            # on the new weights, not lost); the version tells rollouts what they ran on.
            with self.stalling():
                self.server.client.set_weight_version(self.version, reset_prefix_cache=True)
        return {"sync/seconds": time.perf_counter() - t0, "sync/version": float(self.version)}

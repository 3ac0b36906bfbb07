"""mode=shared_vllm: one copy of the weights, trained in place inside vLLM's own CUDA memory.

The server's worker extension exports CUDA IPC handles of every parameter; the trainer rebuilds those tensors
(`torch.multiprocessing.reductions.rebuild_cuda_tensor`) and builds the Hugging Face model with each parameter a
view into them, fused `qkv_proj` / `gate_up_proj` included (`grpo.sync.param_mapping`). Every HF parameter must be
mapped; an unmapped one is an error, never zero-filled. Optimizer steps write in place, so a sync only bumps the
version; generation is paused around the optimizer step so no forward pass reads half-updated weights.

CUDA only: vLLM's CPU backend repacks weights for oneDNN at load time, so writes to the original tensors would
never reach its kernels.
"""

from __future__ import annotations

import base64
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from grpo.inference.process import parallel_sizes
from grpo.options import ConfigError
from grpo.sync.base import SyncContext
from grpo.sync.param_mapping import MappingError, build_views, plan_mapping
from grpo.sync.server_base import ServerSync


def rebuild_meta_buffer_modules(model: nn.Module, config: Any, device: torch.device) -> None:
    """Rebuild on `device` the modules of a meta-built model whose buffers are still on meta (the rotary
    embedding's non-persistent inv_freq: vLLM's tensors hold no such buffer to view)."""
    for mod_name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, child = mod_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device(device):  # not a `device=` argument: transformers deprecates it for these modules
                setattr(parent, child, type(module)(config=config))


class SharedMemorySync(ServerSync):
    """Train views of vLLM's parameters (same host, CUDA); sync = version bump + prefix-cache reset."""

    mode_name = "shared_vllm"
    requires_cuda = True
    uses_lora = False
    fsdp_refusal = "shared_vllm trains vLLM's own CUDA tensors in place, which FSDP2 cannot shard"

    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1) -> None:
        """One vLLM worker (no tensor/pipeline/data parallelism): the trainer trains views of its tensors."""
        sizes = parallel_sizes(cfg.server.extra_args)
        if any(v > 1 for v in sizes.values()):
            what = ", ".join(f"{k} parallel {v}" for k, v in sizes.items() if v > 1)
            raise ConfigError(
                f"mode=shared_vllm trains views of one vLLM worker's tensors and does not support vLLM {what} "
                f"(server.extra_args={list(cfg.server.extra_args)}): each rank would hold only a shard. Use "
                "mode=broadcast (trainer on its own GPU, weights sent to every vLLM rank by NCCL; set server.device) "
                "or drop --tensor-parallel-size (tp=1) to keep mode=shared_vllm."
            )
        if not cuda:
            raise ConfigError(
                "mode=shared_vllm shares CUDA memory with vLLM and needs a CUDA GPU; none is visible here. "
                "Use mode=none, mode=lora_only or mode=lora_restart on this machine."
            )
        super().check_config(cfg, cuda=cuda, world_size=world_size)

    def launch(self, ctx: SyncContext) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "mode=shared_vllm needs CUDA: the trainer trains views of vLLM's CUDA tensors through CUDA IPC, "
                "and vLLM's CPU backend repacks its weights so they cannot be shared. Use mode=none, "
                "mode=lora_restart or mode=lora_only on this machine."
            )
        # Resuming: vLLM loads the checkpoint, so the shared copy starts from the trained weights.
        self._start_server(ctx, Path(ctx.resume_weights or ctx.model_dir))

    def load_model(self, ctx: SyncContext) -> nn.Module:
        """The HF model whose parameters are views into the server's tensors."""
        from transformers import AutoConfig, AutoModelForCausalLM

        res = self.client.rpc("grpo_export_ipc_handles")
        if len(res) != 1:
            raise RuntimeError(f"shared_vllm supports one vLLM worker (tensor parallel 1), got {len(res)}")
        handles = pickle.loads(base64.b64decode(res[0]))
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        vllm_tensors = {name: rebuild_cuda_tensor(*h["args"]) for name, h in handles.items()}
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

    def before_optimizer_step(self) -> None:
        # "keep": in-flight requests freeze (not aborted) and continue after resume. Generation stalls for the
        # optimizer step only (timed into sync/gen_stall_seconds).
        self._paused_at = time.perf_counter()
        self.client.pause()

    def after_optimizer_step(self) -> None:
        try:
            torch.cuda.synchronize()  # the writes must land before vLLM reads again
            self.client.resume()
        finally:
            self.record_stall(time.perf_counter() - self._paused_at)

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        self.version += 1
        # KV blocks cached from older weights must not be reused (running requests are preempted and recomputed on
        # the new weights, not lost); the version tells rollouts what they ran on.
        with self.stalling():
            self.client.set_weight_version(self.version, reset_prefix_cache=True)
        return {"sync/seconds": time.perf_counter() - t0, "sync/version": float(self.version)}

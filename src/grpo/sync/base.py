"""The contract every weight sync (conf/mode/) implements: how trained weights reach the inference server."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal, Mapping, Optional, Sequence

import torch.nn as nn

from grpo.config_values import ConfigError, option
from grpo.inference.client import InferenceServerError
from grpo.schema import ServerConfig
from grpo.serving.server import InferenceServer, Replica
from grpo.serving.session import ServerLaunch
from grpo.sync.arrival import check_arrival

log = logging.getLogger(__name__)

# LoRA ranks vLLM accepts for --max-lora-rank (vllm/config/lora.py).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class SyncContext:
    """The run a sync strategy serves: where it lives and which weights it serves first (also what the run's
    `ServerSession` launches the server for, grpo.serving.session.LaunchContext)."""

    run_dir: Path
    # HF-format directory of the initial weights (the base model for LoRA modes).
    model_dir: Path
    # The `server` config node (grpo.schema.ServerConfig).
    server_cfg: Any
    # The `lora` config node; used by the LoRA modes.
    lora_cfg: Any = None
    tokenizer: Any = None
    # Weights (full HF dir, or adapter dir in LoRA modes) to serve first when resuming; None = model_dir.
    resume_weights: Path | None = None
    # A sweep's job (server.reuse_across_jobs): take the server the job before kept, and keep it for the next one.
    reuse_server: bool = False
    extra: dict = field(default_factory=dict)


def worst_arrival(per_replica: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One replica's arrival figures as they are; several replicas' under `sync/replica<i>/<name>` each, and the
    worst under `sync/<name>`: the lowest served version and match, the largest difference."""
    if len(per_replica) == 1:
        return dict(per_replica[0])
    out: dict[str, float] = {}
    worst = {"sync/served_version": min, "sync/weights_match": min, "sync/weights_max_rel_diff": max}
    for key, pick in worst.items():
        values = [figures[key] for figures in per_replica if key in figures]
        if values:
            out[key] = float(pick(values))
    for i, figures in enumerate(per_replica):
        out |= {f"sync/replica{i}/{key.removeprefix('sync/')}": value for key, value in figures.items()}
    return out


class SyncStrategy(ABC):
    """How trained weights reach the vLLM server. One instance per run: it declares what its mode's server starts
    with (`server_launch`) and moves the weights into the server (`sync`). The server itself, its launch, restarts and
    stop, is the run's `ServerSession`'s (grpo.serving.session), which hands it over (`attach`, then `.server`) and
    asks the strategy for what only it knows: the weights a fresh, reset or restarted server must serve."""

    # The `mode=` option this strategy is (for messages).
    mode_name: ClassVar[str] = "?"
    # True when the trainer trains a LoRA adapter instead of the full model (the server runs with --enable-lora).
    uses_lora: ClassVar[bool] = False
    # How an FSDP2 trainer (torchrun) gathers full weights for this strategy's sync, which every rank joins:
    # "params" (one `full_tensor()` per parameter), "state_dict" (one full state dict on rank 0), "adapter" (the
    # trainable parameters alone: a LoRA adapter, the frozen base never gathered), or None when the strategy does
    # not compose with FSDP2 (refused at start-up). See grpo.sync.follower.FollowerSync.
    fsdp_gather: ClassVar[Optional[Literal["params", "state_dict", "adapter"]]] = None
    # Why FSDP2 is refused (fsdp_gather None), for the start-up message.
    fsdp_refusal: ClassVar[str] = "its sync has no FSDP2 gather"
    # Why vLLM cannot quantize this mode's served weights itself (server.quantization=fp8), for the start-up message;
    # None where it can: every sync reloads the trainer's weights through vLLM's loader, which quantizes them anew.
    quantization_refusal: ClassVar[Optional[str]] = "its syncs do not reload the weights through vLLM's loader"
    # True when a sweep's next job may take over this mode's server and reset what it serves
    # (`reset_served_weights`) instead of starting another (server.reuse_across_jobs, docs/sweeps.md).
    reuses_server: ClassVar[bool] = False
    # When the served weights change: at the sync (False), or at every optimizer step (True: the trainer writes the
    # server's own tensors, shared_vllm). An evaluation beside training must have generated before then.
    serves_weights_in_place: ClassVar[bool] = False

    def __init__(self, sync_every: int = 1) -> None:
        if sync_every < 1:
            raise ValueError(f"mode.sync_every must be >= 1, got {sync_every}")
        self.sync_every = sync_every
        # Weight version served right now; rollouts carry it so a batch traces back to its weights.
        self.version = 0
        # The server the weights go to, handed over by the run's ServerSession (`attach`); until then one without
        # replicas (torchrun ranks > 0 never serve one).
        self.server = InferenceServer()
        self.ctx: SyncContext | None = None
        self._stall_s = 0.0
        self._drain_s = 0.0

    # ------------------------------------------------------------------ start-up checks
    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1,
                     local_world_size: int | None = None) -> None:
        """Refuse a run config this strategy cannot serve, before any model loads (ConfigError naming the key).
        `cfg` is the whole run config; subclasses add their own checks to these. `world_size`: the trainer's ranks;
        `local_world_size`: those on this host (torchrun's LOCAL_WORLD_SIZE; None = all of them)."""
        sync_every = cfg.mode.sync_every
        if sync_every < 1:  # the constructor's own check comes only after the run's first start-up lines
            raise ConfigError(f"mode.sync_every must be >= 1 (sync after every N rollout batches), got {sync_every}")
        if world_size > 1 and cls.fsdp_gather is None:
            raise ConfigError(
                f"a torchrun trainer ({world_size} processes, FSDP2) composes with mode=none, mode=broadcast, "
                f"mode=lora_only or mode=lora_restart, not mode={cls.mode_name} ({cls.fsdp_refusal}); run it with "
                f"mode=none, or mode=broadcast server.device=<a GPU index >= {world_size}>, or run one process for "
                "this mode"
            )
        quantization = option(cfg.server, "quantization", None)
        if quantization is not None and cls.quantization_refusal is not None:
            raise ConfigError(
                f"server.quantization={quantization} with mode={cls.mode_name}: {cls.quantization_refusal}; use "
                "mode=none or mode=broadcast (mode.receive=engine), whose syncs reload the trained weights through "
                "vLLM's loader, which quantizes them at every sync, or set server.quantization=null")
        if cls.uses_lora:
            r, max_rank = option(cfg.lora, "r"), option(cfg.server, "max_lora_rank")
            if r not in VLLM_LORA_RANKS:
                raise ConfigError(f"lora.r={r} is not a rank vLLM serves; use one of {VLLM_LORA_RANKS}")
            if r > max_rank:
                raise ConfigError(f"lora.r={r} exceeds server.max_lora_rank={max_rank}; raise the latter")
            if cuda and str(option(cfg.server, "dtype", ServerConfig.dtype)) == "float32":
                # vLLM's GPU LoRA kernels (punica/triton) assert fp16/bf16 weights: the engine would die at start-up.
                raise ConfigError(f"mode={cls.mode_name} on a GPU: vLLM serves LoRA adapters in float16 or bfloat16 "
                                  "only, not server.dtype=float32; set server.dtype=bfloat16 (the trainer keeps "
                                  "model.dtype)")

    # ------------------------------------------------------------------ what the server serves
    def server_launch(self, ctx: SyncContext) -> ServerLaunch | None:
        """What this mode's server starts with (the weights it loads, adapters preloaded, environment, flags); the
        run's `ServerSession` (grpo.serving.session) launches it. None (the default) when the strategy serves
        nothing: no server is started (torchrun ranks > 0, a stand-in of one's own)."""
        return None

    def attach(self, server: InferenceServer, ctx: SyncContext) -> None:
        """The server this strategy moves weights to (the run's `ServerSession` hands it over before launching
        it) and the run it serves."""
        self.server, self.ctx = server, ctx

    def serve_initial_weights(self) -> None:
        """The server is up (launched, attached, or taken from a sweep's job before and reset): put in place what
        its command line does not load (a resumed adapter, a checkpoint into a server started elsewhere, the NCCL
        group). Nothing by default."""

    def reset_served_weights(self, model: Path) -> None:
        """A server kept by a sweep's previous job of this mode: serve the initial weights `model` again at this
        job's weight version, with an empty prefix cache (reloaded in place; vLLM's reload resets the cache)."""
        self.server.each(lambda replica: replica.client.reload_weights(str(model), version=self.version))

    def restore_replica(self, replica: Replica) -> None:
        """The server found `replica` dead: restart it on the current weights (modes whose weights live outside
        the server's command line, e.g. hot-swapped adapters, put them back)."""
        replica.process.restart(weight_version=self.version)

    def await_served_weights(self) -> None:
        """Before generation reads the endpoint: a weight update still landing after `sync` returned lands first
        (mode.reload=background). Nothing by default."""

    def detach(self) -> bool:
        """Before the server stops (or is kept for a sweep's next job): let go of it (end a weight update in
        flight, unload this job's adapters from a shared server, drop a weight-transfer group). False when the server
        must not be kept. Safe to call twice."""
        return True

    def load_model(self, ctx: SyncContext) -> nn.Module | None:
        """Build the trainable model when the strategy owns its memory (shared_vllm); None = the usual loader."""
        return None

    @property
    def served_model(self) -> str | None:
        """Model name to put in requests (the adapter name in LoRA modes); None = the server's default."""
        return None

    # ------------------------------------------------------------------ moving weights
    def before_optimizer_step(self) -> None:
        """Called right before optimizer.step() (shared_vllm pauses generation here)."""

    def after_optimizer_step(self) -> None:
        """Called right after optimizer.step()."""

    @abstractmethod
    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        """Make the server serve `model`'s current weights; returns at least sync/seconds and sync/version."""

    def check_arrival(self, model: nn.Module) -> dict[str, float]:
        """After a sync: the version each replica serves and whether its weights equal the trainer's (a fingerprint
        of a few parameters, grpo.sync.arrival). The LoRA modes report the served version only: their base weights
        never change, and the adapter lives outside the model's parameters. Nothing without a server (ranks > 0).
        With several replicas, each one's figures under `sync/replica<i>/` and the worst of them under `sync/`."""
        if not self.server.replicas:
            return {}
        t0 = time.perf_counter()
        try:
            per_replica = self.server.each(
                lambda replica: check_arrival(model, replica.client, self.version, fingerprint=not self.uses_lora,
                                              served=self.served_model if self.uses_lora else None))
        except InferenceServerError as error:  # a dead server is the next generation's to restart, not the check's
            log.warning("the arrival check after the sync to version %d failed: %s", self.version, error)
            return {"sync/arrival_check_failed": 1.0}
        return {**worst_arrival(per_replica), "sync/arrival_check_seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------ generation stall
    @contextmanager
    def stalling(self, drain: bool = False) -> Iterator[None]:
        """Time a section during which the server cannot generate because of a weight update (engine paused, a
        reload holding the engine, no server during a restart). `drain=True` (restarts): first wait for the
        generation in flight and keep new generation out (`server.gate.held`); the drain itself is not a stall (the
        requests in flight still run) and is timed apart."""
        if not drain:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.record_stall(time.perf_counter() - t0)
            return
        with self.server.gate.held() as drained:
            self._drain_s += drained
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.record_stall(time.perf_counter() - t0)

    def record_stall(self, seconds: float) -> None:
        """Add `seconds` during which the server could not generate because of a weight update (a pause window a
        strategy times itself, e.g. shared_vllm's optimizer step)."""
        self._stall_s += seconds

    def take_generation_stall(self) -> dict[str, float]:
        """Since the last call: `sync/gen_stall_seconds` (the server could not generate because of weight updates)
        and `sync/drain_seconds` (a restarting sync waited for generation in flight); resets both."""
        out = {"sync/gen_stall_seconds": self._stall_s, "sync/drain_seconds": self._drain_s}
        self._stall_s = self._drain_s = 0.0
        return out

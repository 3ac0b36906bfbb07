"""The contract every weight-sync strategy (conf/mode/) implements."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal, Optional

import torch.nn as nn

from grpo.inference.client import Endpoint
from grpo.options import ConfigError, option

# LoRA ranks vLLM accepts for --max-lora-rank (vllm/config/lora.py).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class SyncContext:
    """What a sync strategy needs to start serving: where the run lives and which weights to serve first."""

    run_dir: Path
    # HF-format directory of the initial weights (the base model for LoRA modes).
    model_dir: Path
    # The `server` config node (grpo.config.schema.ServerConfig).
    server_cfg: Any
    # The `lora` config node; used by the LoRA modes.
    lora_cfg: Any = None
    tokenizer: Any = None
    # Weights (full HF dir, or adapter dir in LoRA modes) to serve first when resuming; None = model_dir.
    resume_weights: Path | None = None
    extra: dict = field(default_factory=dict)


class GenerationGate:
    """Lets a sync that takes the server away (a restart) wait for the generation in flight and keep new generation
    out meanwhile, so no request is sent to a server that is going down.

    The rollout side wraps each generation call in `generating()`; the sync side runs the restart inside `held()`.
    `held` first closes the gate (new `generating` calls wait), then waits until the calls in flight have ended:
    they always end, with an answer or the client's error after its retries, and the sync holds nothing they need,
    so neither side can wait on the other forever. Both may be entered from any thread; not re-entrant.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        # Seconds generation calls spent waiting at the closed gate (the generator's own view of the stall).
        self.waited_s = 0.0

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around one generation call: waits while a sync holds the gate."""
        with self._cond:
            t0 = time.monotonic()
            while self._closed:
                self._cond.wait()
            self.waited_s += time.monotonic() - t0
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def held(self) -> Iterator[float]:
        """Close the gate, wait for the calls in flight (drain); yields the seconds that took; reopens on exit."""
        with self._cond:
            self._closed = True
            t0 = time.monotonic()
            while self._active:
                self._cond.wait()
            drained = time.monotonic() - t0
        try:
            yield drained
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


class SyncStrategy(ABC):
    """How trained weights reach the vLLM server. One instance per run; owns the server process it launches."""

    # The `mode=` option this strategy is (for messages).
    mode_name: ClassVar[str] = "?"
    # True when the trainer trains a LoRA adapter instead of the full model.
    uses_lora: ClassVar[bool] = False
    # True when the strategy only works with CUDA (broadcast: NCCL).
    requires_cuda: ClassVar[bool] = False
    # How an FSDP2 trainer (torchrun) gathers full weights for this strategy's sync, which every rank joins:
    # "params" (one `full_tensor()` per parameter), "state_dict" (one full state dict on rank 0), or None when
    # the strategy does not compose with FSDP2 (refused at start-up). See grpo.sync.follower.FollowerSync.
    fsdp_gather: ClassVar[Optional[Literal["params", "state_dict"]]] = None

    def __init__(self, sync_every: int = 1) -> None:
        if sync_every < 1:
            raise ValueError(f"mode.sync_every must be >= 1, got {sync_every}")
        self.sync_every = sync_every
        # Weight version served right now; rollouts carry it so a batch traces back to its weights.
        self.version = 0
        # Rollouts generate through it (PipelineContext.generation_gate); restarting syncs drain and hold it.
        self.gate = GenerationGate()
        self._stall_s = 0.0
        self._drain_s = 0.0

    # ------------------------------------------------------------------ generation stall
    @contextmanager
    def stalling(self, drain: bool = False) -> Iterator[None]:
        """Time a section during which the server cannot generate because of a weight update (engine paused, a
        reload holding the engine, no server during a restart). `drain=True` (restarts): first wait for the
        generation in flight and keep new generation out (`gate.held`); the drain itself is not a stall (the
        requests in flight still run) and is timed apart."""
        if not drain:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.record_stall(time.perf_counter() - t0)
            return
        with self.gate.held() as drained:
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

    # ------------------------------------------------------------------ start-up checks
    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1) -> None:
        """Refuse a run config this strategy cannot serve, before any model loads (ConfigError naming the key).
        `cfg` is the whole run config; subclasses add their own checks to these."""
        sync_every = option(cfg.mode, "sync_every", 1)
        if sync_every < 1:  # the constructor's own check comes only after the run's first start-up lines
            raise ConfigError(f"mode.sync_every must be >= 1 (sync after every N rollout batches), got {sync_every}")
        if cls.requires_cuda and not cuda:
            raise ConfigError(
                f"mode={cls.mode_name} needs a CUDA GPU; none is visible here. Use mode=none, mode=lora_only or "
                "mode=lora_restart on this machine."
            )
        if world_size > 1 and cls.fsdp_gather is None:
            raise ConfigError(
                f"a torchrun trainer ({world_size} processes, FSDP2) composes with mode=none or mode=broadcast, not "
                f"mode={cls.mode_name} ({cls.fsdp_refusal}); run it with mode=none, or mode=broadcast "
                f"server.device=<a GPU index >= {world_size}>, or run one process for this mode"
            )
        if cls.uses_lora:
            r, max_rank = option(cfg.lora, "r"), option(cfg.server, "max_lora_rank")
            if r not in VLLM_LORA_RANKS:
                raise ConfigError(f"lora.r={r} is not a rank vLLM serves; use one of {VLLM_LORA_RANKS}")
            if r > max_rank:
                raise ConfigError(f"lora.r={r} exceeds server.max_lora_rank={max_rank}; raise the latter")

    # Why FSDP2 is refused (fsdp_gather None), for the start-up message.
    fsdp_refusal: ClassVar[str] = "LoRA adapters are not sharded with FSDP2 here"

    # ------------------------------------------------------------------ serving
    @abstractmethod
    def launch(self, ctx: SyncContext) -> None:
        """Start (or attach to) the inference server serving the initial weights."""

    def load_model(self, ctx: SyncContext) -> nn.Module | None:
        """Build the trainable model when the strategy owns its memory (shared_vllm); None = the usual loader."""
        return None

    def before_optimizer_step(self) -> None:
        """Called right before optimizer.step() (shared_vllm pauses generation here)."""

    def after_optimizer_step(self) -> None:
        """Called right after optimizer.step()."""

    @abstractmethod
    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        """Make the server serve `model`'s current weights; returns at least sync/seconds and sync/version."""

    @property
    @abstractmethod
    def base_url(self) -> str:
        """Base URL of the server (http://host:port)."""

    @property
    def served_model(self) -> str | None:
        """Model name to put in requests (the adapter name in LoRA modes); None = the server's default."""
        return None

    def endpoint(self) -> Endpoint:
        """The server a pipeline or evaluator samples the current policy from (read it anew for every request
        batch: a restart may move the server and a sync advances the version)."""
        return Endpoint(base_url=self.base_url, model=self.served_model, version=int(self.version))

    # ------------------------------------------------------------------ faults
    @property
    def restarts(self) -> int:
        """Restarts of a dead or hung server so far in this session (`server/restarts` in every metrics row)."""
        return 0

    def prepare_step(self, step: int) -> None:
        """Before optimizer step `step` (1-based): make sure the server is up (restart a dead one, bounded)."""
        self.check_health()

    def check_health(self) -> bool:
        """Restart a dead server (bounded); True when it did, False when all was well; raise when it cannot."""
        return False

    def recover(self, error: BaseException) -> bool:
        """`error` interrupted generation: when it means the server died, restart it (bounded) and return True so
        the caller retries; False when the error is not the server's (the caller re-raises it)."""
        return False

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every process this strategy started. Safe to call twice."""

"""The contract every weight-sync strategy (conf/mode/) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch.nn as nn

from grpo.inference.client import Endpoint


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


class SyncStrategy(ABC):
    """How trained weights reach the vLLM server. One instance per run; owns the server process it launches."""

    # True when the trainer trains a LoRA adapter instead of the full model.
    uses_lora: ClassVar[bool] = False
    # True when the strategy only works with CUDA (shared_vllm).
    requires_cuda: ClassVar[bool] = False
    # How an FSDP2 trainer (torchrun) gathers full weights for this strategy's sync, which every rank joins:
    # "params" (one `full_tensor()` per parameter), "state_dict" (one full state dict on rank 0), or None when
    # the strategy does not compose with FSDP2 (refused at start-up). See grpo.trainer.distributed.FollowerSync.
    fsdp_gather: ClassVar[str | None] = None

    def __init__(self, sync_every: int = 1) -> None:
        if sync_every < 1:
            raise ValueError(f"mode.sync_every must be >= 1, got {sync_every}")
        self.sync_every = sync_every
        # Weight version served right now; rollouts carry it so a batch traces back to its weights.
        self.version = 0

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

    def check_health(self) -> bool:
        """Restart a dead server (bounded); True when it did, False when all was well; raise when it cannot."""
        return False

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every process this strategy started. Safe to call twice."""

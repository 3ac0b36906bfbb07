"""mode=lora_restart: each sync saves the LoRA adapter and restarts vLLM with it preloaded (--lora-modules).

CUDA graphs stay on (no --enforce-eager). The price is a full vLLM start-up per sync, during which there is no
server; lora_only avoids it by hot-swapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn

from grpo.config_values import ConfigError
from grpo.schema.sync import LoraRestartSyncConfig
from grpo.serving.server import external_setting, external_urls
from grpo.serving.session import ServerLaunch
from grpo.sync.base import SyncContext, SyncStrategy
from grpo.sync.weight_dirs import prune, save_and_load
from grpo.weights.hf_dir import save_model_weights
from grpo.weights.params import full_trainable_params, is_sharded, trainable_bytes


def save_adapter(model: nn.Module, out_dir: Path) -> tuple[Path, dict[str, float]]:
    """The PEFT adapter of `model` in `out_dir`, written atomically; not fsynced: adapters are rewritten from the
    trainer's at every sync (checkpoints are durable). With the figures of what moved: `sync/adapter_bytes` (the
    adapter's full size) and `sync/gathered_bytes` (what was all-gathered from FSDP2 shards: the adapter alone,
    never the frozen base; 0 in one process). Sharded, it is a collective the other ranks join through
    `FollowerSync` (gather "adapter")."""
    adapter, gathered = full_trainable_params(model) if is_sharded(model) else (None, 0)
    path = save_model_weights(model, None, out_dir, adapter, durable=False)
    return path, {"sync/adapter_bytes": float(trainable_bytes(model)), "sync/gathered_bytes": float(gathered)}


class LoraRestartSync(SyncStrategy):
    """Save the adapter to `<run_dir>/adapters/vN`; restart vLLM serving it as `adapter_name`."""

    mode_name = "lora_restart"
    uses_lora = True
    fsdp_gather = "adapter"  # FSDP2: every rank joins the gather of the adapter, rank 0 saves it and restarts vLLM
    quantization_refusal = ("its base weights are loaded once, never reloaded, and LoRA adapters over a base vLLM "
                            "quantized itself are not supported here")

    def __init__(self, sync_every: int = LoraRestartSyncConfig.sync_every, adapter_name: str = "policy") -> None:
        super().__init__(sync_every)
        self.adapter_name = adapter_name
        self._adapter_dir: Path | None = None

    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1,
                     local_world_size: int | None = None) -> None:
        super().check_config(cfg, cuda=cuda, world_size=world_size, local_world_size=local_world_size)
        if external_urls(cfg.server):  # else a RuntimeError traceback once the model was built
            raise ConfigError(f"mode=lora_restart restarts the vLLM server at every sync, so it cannot use a server "
                              f"started elsewhere ({external_setting(cfg.server)}); use "
                              "mode=lora_only (adapters hot-swapped into that server), or drop server.external_url(s)")

    def server_launch(self, ctx: SyncContext) -> ServerLaunch:
        adapter = Path(ctx.resume_weights) if ctx.resume_weights else None
        return ServerLaunch(Path(ctx.model_dir), lora_modules={self.adapter_name: adapter} if adapter else None)

    def serve_initial_weights(self) -> None:
        # A resumed adapter was preloaded by the server's command line (`server_launch`).
        self._adapter_dir = Path(self.ctx.resume_weights) if self.ctx.resume_weights else None

    @property
    def served_model(self) -> str | None:
        # Before the first sync the adapter is the fresh one (B = 0), i.e. the base model.
        return self.adapter_name if self._adapter_dir else None

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        return save_and_load(self, "adapters", lambda d: save_adapter(model, d), self._serve_adapter, step)

    def _serve_adapter(self, out: Path, version: int) -> None:
        # The restart drains first: the rollouts in flight finish on the old server, new ones wait for the new one.
        with self.stalling(drain=True):
            self.server.restart(lora_modules={self.adapter_name: out}, weight_version=version)
        self._adapter_dir = out
        prune(self.ctx.run_dir, "adapters", keep={out})

"""mode=lora_only: each sync hot-swaps the LoRA adapter into the running vLLM through its LoRA endpoints.

The adapter is loaded under a new versioned name (`policy-v3`), `served_model` switches to it so the next rollouts
use it, and the previous version is unloaded one sync later, so requests still running on it finish instead of
failing. No --enforce-eager: vLLM runs LoRA inside its CUDA graphs.

`mode.shared_server=true` (what the parallel launcher sets for LoRA configurations at once, docs/sweeps.md): the
server, attached by `server.external_url`, serves other jobs' adapters too. Each job's adapters carry its own
`mode.adapter_prefix`, each adapter its own weight version (set per adapter on the server, which requests naming it
report); the server's own version is left alone, and the job unloads its adapters when it ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.nn as nn

from grpo.config_values import ConfigError, option
from grpo.schema import LoraHotSwapSyncConfig
from grpo.serving.server import Replica, external_urls
from grpo.serving.session import ServerLaunch
from grpo.sync.base import SyncContext, SyncStrategy
from grpo.sync.lora_restart import save_adapter
from grpo.sync.weight_dirs import prune, save_and_load

log = logging.getLogger(__name__)


class LoraHotSwapSync(SyncStrategy):
    """Save the adapter to `<run_dir>/adapters/vN`, load it as `<prefix>-vN` via /v1/load_lora_adapter."""

    mode_name = "lora_only"
    uses_lora = True
    fsdp_gather = "adapter"  # FSDP2: every rank joins the gather of the adapter, rank 0 saves and loads it
    quantization_refusal = ("its base weights are loaded once, never reloaded, and LoRA adapters over a base vLLM "
                            "quantized itself are not supported here")
    reuses_server = True  # a sweep's next job unloads the adapters: the base weights never change

    def __init__(self, sync_every: int = LoraHotSwapSyncConfig.sync_every,
                 adapter_prefix: str = LoraHotSwapSyncConfig.adapter_prefix,
                 shared_server: bool = LoraHotSwapSyncConfig.shared_server) -> None:
        super().__init__(sync_every)
        self.adapter_prefix = adapter_prefix
        self.shared_server = shared_server
        self._current: str | None = None
        self._current_dir: Path | None = None
        self._previous: str | None = None
        self._previous_dir: Path | None = None

    def _name(self, version: int) -> str:
        return f"{self.adapter_prefix}-v{version}"

    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1,
                     local_world_size: int | None = None) -> None:
        super().check_config(cfg, cuda=cuda, world_size=world_size, local_world_size=local_world_size)
        shared = option(cfg.mode, "shared_server", LoraHotSwapSyncConfig.shared_server)
        if shared and len(external_urls(cfg.server)) != 1:
            raise ConfigError("mode.shared_server=true trains an adapter on a server other jobs share: attach to it "
                              "with server.external_url=http://host:port (the parallel launcher sets both)")
        k = cfg.train.max_staleness
        if k > 1:
            raise ConfigError(
                f"train.max_staleness={k} with mode=lora_only: each sync unloads the adapter of two syncs before, which "
                "a batch generated up to k syncs earlier may still be using; use train.max_staleness=1 with lora_only"
            )

    def server_launch(self, ctx: SyncContext) -> ServerLaunch:
        return ServerLaunch(Path(ctx.model_dir))  # a resumed adapter is loaded once the server answers

    def serve_initial_weights(self) -> None:
        if self.ctx.resume_weights:
            self._current, self._current_dir = self._name(self.version), Path(self.ctx.resume_weights)
            self.server.each(lambda replica: replica.client.load_lora(self._current, str(self._current_dir)))
            self._set_version(self._current, self.version)

    def reset_served_weights(self, model: Path) -> None:
        """The server of a sweep's previous job: unload every adapter it loaded (the served names are the base
        model's), so this job's `policy-vN` are its own; the version set back and the prefix cache emptied."""
        def reset(replica: Replica) -> None:
            base = set(replica.process.served_model_names) if replica.process is not None else set()
            for name in replica.client.models():
                if name not in base:
                    replica.client.unload_lora(name)
            replica.client.set_weight_version(self.version, reset_prefix_cache=True)

        self.server.each(reset)

    @property
    def served_model(self) -> str | None:
        return self._current

    def restore_replica(self, replica: Replica) -> None:
        # A fresh server holds no hot-swapped adapter: load the previous one (still named by the requests in flight
        # on the other replicas, and unloaded from every replica at the next sync) and the current one again.
        replica.process.restart(weight_version=self.version)
        if self._previous is not None:
            replica.client.load_lora(self._previous, str(self._previous_dir))
        if self._current is not None:
            replica.client.load_lora(self._current, str(self._current_dir))

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        return save_and_load(self, "adapters", lambda d: save_adapter(model, d), self._swap_in, step)

    def _swap_in(self, out: Path, version: int) -> None:
        name, previous = self._name(version), self._previous

        def swap(replica: Replica) -> None:
            replica.client.load_lora(name, str(out))
            # Unload the adapter from two syncs ago; the one just replaced may still have requests in flight.
            if previous is not None:
                replica.client.unload_lora(previous)

        # vLLM adds and removes adapters between engine steps: generation stalls that long, nothing is paused. Every
        # replica holds the new adapter before any request names it (`served_model` switches after this).
        with self.stalling():
            self.server.each(swap)
        self._previous, self._current = self._current, name
        self._set_version(name, version)
        keep = {out} | ({self._current_dir} if self._current_dir else set())
        self._previous_dir, self._current_dir = self._current_dir, out
        prune(self.ctx.run_dir, "adapters", keep=keep)

    def _set_version(self, name: str, version: int) -> None:
        """The server reports `version` for rollouts of adapter `name`: its own version (a server this job owns), or
        that adapter's alone (a shared server: the other jobs count their own versions)."""
        model = name if self.shared_server else None
        self.server.each(lambda replica: replica.client.set_weight_version(version, model=model))

    def detach(self) -> bool:
        """A shared server keeps serving the other jobs: unload this job's adapters from it (a failure is logged,
        the server's owner stops it at the sweep's end)."""
        if self.shared_server and self.server.replicas:
            for name in (self._previous, self._current):
                if name is None:
                    continue
                try:
                    self.server.each(lambda replica, n=name: replica.client.unload_lora(n))
                except Exception as error:  # noqa: BLE001 - the server's owner stops it at the sweep's end anyway
                    log.warning("unloading adapter %s from the shared server failed: %s", name, error)
            self._previous = self._current = None
        return True

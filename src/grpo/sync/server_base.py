"""Shared plumbing of the sync strategies: launching (or attaching to) the server, health, restarts, shutdown."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Mapping

from grpo import faults
from grpo.inference.client import InferenceClient, InferenceServerError, ServerUnreachable
from grpo.inference.process import VLLMServer
from grpo.options import ConfigError, option
from grpo.sync.base import SyncContext, SyncStrategy

log = logging.getLogger(__name__)


class ServerSync(SyncStrategy):
    """A SyncStrategy that owns one `VLLMServer` (or attaches to `server.external_url`)."""

    # Whether the server must run with --enable-lora.
    enable_lora: bool = False

    def __init__(self, sync_every: int = 1) -> None:
        super().__init__(sync_every)
        self.server: VLLMServer | None = None
        self.client: InferenceClient | None = None
        self.ctx: SyncContext | None = None
        self._external_url: str | None = None
        self._restarts_used = 0

    # ------------------------------------------------------------------ launch
    def _start_server(
        self, ctx: SyncContext, model: Path, lora_modules: Mapping[str, Path] | None = None
    ) -> None:
        self.ctx = ctx
        external = option(ctx.server_cfg, "external_url")
        if external:
            self._external_url = external.rstrip("/").removesuffix("/v1")
            # A server started with a run token (GRPO_SERVER_TOKEN in its environment) needs it for weight calls.
            self.client = InferenceClient(self._external_url, token=os.environ.get("GRPO_SERVER_TOKEN"))
            if not self.client.health():  # the user's URL: a message, not a traceback
                raise ConfigError(f"server.external_url={external} does not answer /health: start that server first "
                                  "(grpo-serve <vLLM args>), or drop server.external_url and the run starts its own")
            served = self.client.weight_version()
            if served != self.version:
                # Rollouts carry the server's versions and the trainer compares them with its own (staleness):
                # one scale. A server attached from an earlier run may count from elsewhere.
                log.info("attached server reports weight version %d; setting it to the run's %d", served, self.version)
                self.client.set_weight_version(self.version)
            return
        self.server = VLLMServer(
            model,
            ctx.server_cfg,
            log_path=Path(ctx.run_dir) / "logs" / "vllm.log",
            lora_modules=lora_modules,
            enable_lora=self.enable_lora,
            # A stable name across restarts and weight directories, so requests never need to change it; then the
            # aliases in server.served_model_aliases (e.g. model.name) that Atropos environments may ask for.
            served_model_name=[str(ctx.model_dir), *(option(ctx.server_cfg, "served_model_aliases", None) or [])],
            weight_version=self.version,
            env=self.server_environment(),
        )
        self.server.start()
        self.client = InferenceClient(self.server.url, token=self.server.token)  # token: weight-changing calls

    def server_environment(self) -> dict[str, str]:
        """Environment variables this strategy's server needs besides the launcher's own (none by default)."""
        return {}

    @property
    def base_url(self) -> str:
        if self._external_url:
            return self._external_url
        if self.server is None:
            raise RuntimeError("sync strategy not launched")
        return self.server.url

    # ------------------------------------------------------------------ health
    # A hung (stopped, deadlocked) server accepts the connection but never answers; this bounds the wait.
    health_timeout_s: float = 10.0

    def check_health(self) -> bool:
        """Restart a dead or unresponsive server on the current weights, up to server.max_restarts times in the
        run; raise after that. True when it restarted the server, False when it was healthy."""
        if self.server is None:
            if self.client is not None and not self.client.health():
                raise RuntimeError(f"external inference server {self._external_url} is not healthy")
            return False
        if self.server.healthy(timeout=self.health_timeout_s):
            return False
        limit = int(option(self.ctx.server_cfg, "max_restarts", 3))
        state = "exited" if not self.server.running() else f"not answering /health within {self.health_timeout_s:g}s"
        tail = self.server.log_tail(40)
        if self._restarts_used >= limit:
            raise RuntimeError(
                f"inference server {state}; giving up after {limit} restarts (server.max_restarts={limit}). "
                f"Log {self.server.log_path}, tail:\n{tail}"
            )
        self._restarts_used += 1
        log.warning("inference server %s; restart %d of %d on weight version %d", state, self._restarts_used, limit,
                    self.version)
        self._restart_current()
        return True

    @property
    def restarts(self) -> int:
        return self._restarts_used

    def prepare_step(self, step: int) -> None:
        # GRPO_FAULT (tests) kills or stops our server here, so the health check below must notice.
        faults.server_faults(step, self.server.pid if self.server is not None else None)
        self.check_health()

    def recover(self, error: BaseException) -> bool:
        # A server error while the server answers /health is not a crash: the caller re-raises it. Except when the
        # server did not answer at all and answers now: it was restarted meanwhile (asynchronous rollouts: the
        # step's health check, or a restarting sync, ran while the producer's requests failed), so retry.
        if not isinstance(error, InferenceServerError):
            return False
        return self.check_health() or isinstance(error, ServerUnreachable)

    def _restart_current(self) -> None:
        """Restart the server serving the current weights (subclasses whose weights live outside the server
        command line, e.g. hot-swapped adapters, put them back)."""
        self.server.restart(weight_version=self.version)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.client is not None:
            self.client.close()

    # ------------------------------------------------------------------ weight directories
    def _save_and_load(
        self, kind: str, save: Callable[[Path], Path], load: Callable[[Path, int], Mapping[str, float] | None],
        step: int,
    ) -> dict[str, float]:
        """One sync of a file-based mode: ``save`` the weights into ``<run_dir>/<kind>/v<next version>``, have the
        server ``load(dir, version)`` them, then advance the version. Returns the timings every such mode reports
        plus whatever ``load`` adds."""
        t0 = time.perf_counter()
        version = self.version + 1
        out = save(self._versioned_dir(kind, version))
        t_saved = time.perf_counter()
        if self.server is not None:  # GRPO_FAULT (tests): the server dies while the sync runs
            faults.kill_server_syncing(step, self.server.pid_path)
        extra = dict(load(out, version) or {})
        self.version = version
        t1 = time.perf_counter()
        return {
            "sync/seconds": t1 - t0,
            "sync/save_seconds": t_saved - t0,
            "sync/load_seconds": t1 - t_saved,
            **extra,
            "sync/version": float(version),
        }

    def _versioned_dir(self, kind: str, version: int) -> Path:
        return Path(self.ctx.run_dir) / kind / f"v{version}"

    def _prune(self, kind: str, keep: set[Path]) -> None:
        """Delete old versioned directories except `keep` (the served one and the one being switched to)."""
        root = Path(self.ctx.run_dir) / kind
        if not root.exists():
            return
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("v") and d not in keep:
                shutil.rmtree(d, ignore_errors=True)

"""mode=none: full fine-tuning; each sync saves the full HF weights to disk, then vLLM reloads them.

The server stays up: the weights are reloaded in place on every vLLM worker (vLLM's layer-wise `reload_weights`
through our worker extension and `collective_rpc`, ~0.03 s for the tiny model on CPU). Only when that is not
possible (an external server without our endpoints, or a failed reload) does it fall back to restarting vLLM on the
new directory, which leaves rollouts without a server for the whole start-up (~30 s here). A server found dead or
hung when the reload fails is a crash: restarted through the health check (counted, bounded), then reloaded.

`reload=background` runs that in-place reload on a thread of its own: the sync returns once the weights are saved,
and the trainer goes on with the next rollout batch (asynchronous rollouts, `train.max_staleness >= 1`) while vLLM
loads them. Generation waits for the reload (the server session's `endpoint()` blocks in `await_served_weights` until
it has landed), so no request is admitted on weights older than the version the trainer reports; the next sync, an
evaluation and the end of the run wait for it too, and a reload that failed is redone there, on the trainer's thread,
through the path above (health check, restart).

Under torchrun (FSDP2) only rank 0 holds this strategy; its sync gathers the full state dict, which the other
ranks join through `grpo.sync.follower.FollowerSync` (`fsdp_gather = "state_dict"`), then rank 0 alone saves
and drives the server.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.nn as nn

from grpo.config_values import ConfigError, option
from grpo.inference.client import InferenceServerError
from grpo.schema import CheckpointRestartSyncConfig
from grpo.serving.server import Replica, external_setting, external_urls
from grpo.serving.session import ServerLaunch
from grpo.sync.base import SyncContext, SyncStrategy
from grpo.sync.weight_dirs import prune, save_and_load
from grpo.weights.params import save_full_weights

log = logging.getLogger(__name__)

# How vLLM takes the saved weights (mode.reload).
RELOADS = ("inplace", "restart", "background")


class SaveAndReloadSync(SyncStrategy):
    """Save full weights to `<run_dir>/served_weights/vN`, reload them in place (or restart vLLM on them).

    `reload`: "inplace" (default; falls back to restart on failure) or "restart" (always restart).
    """

    mode_name = "none"
    uses_lora = False
    reuses_server = True  # a sweep's next job reloads the initial weights in place
    fsdp_gather = "state_dict"  # FSDP2: every rank joins one full state dict gather, rank 0 saves it
    quantization_refusal = None  # vLLM reloads (or restarts on) the saved weights with its loader: quantized anew

    def __init__(self, sync_every: int = CheckpointRestartSyncConfig.sync_every,
                 reload: str = CheckpointRestartSyncConfig.reload) -> None:
        super().__init__(sync_every)
        if reload not in RELOADS:
            raise ValueError(f"reload must be one of {RELOADS}, got {reload!r}")
        self.reload = reload
        self.served_dir: Path | None = None
        # reload=background: the reload in flight (its directory, version and future) and its worker thread; the
        # event is set when none is in flight. The thread that built the strategy (the trainer's) redoes a failed one.
        self._pending: tuple[Path, int, Future] | None = None
        self._landed = threading.Event()
        self._landed.set()
        self._reloader = ThreadPoolExecutor(1, thread_name_prefix="grpo-reload") if reload == "background" else None
        self._owner = threading.get_ident()
        self._last_reload_s = 0.0

    @classmethod
    def check_config(cls, cfg: Any, *, cuda: bool, world_size: int = 1,
                     local_world_size: int | None = None) -> None:
        super().check_config(cfg, cuda=cuda, world_size=world_size, local_world_size=local_world_size)
        reload = option(cfg.mode, "reload", CheckpointRestartSyncConfig.reload)
        if reload not in RELOADS:
            raise ConfigError(f"mode.reload={reload} is not one of {', '.join(RELOADS)} (inplace: vLLM reloads the "
                              "saved weights in place; restart: it restarts on them every sync; background: inplace on "
                              "a thread of its own while the trainer goes on)")
        if reload == "restart" and external_urls(cfg.server):  # else a RuntimeError at the first sync
            raise ConfigError(f"mode.reload=restart restarts the vLLM server at every sync, so it cannot use a server "
                              f"started elsewhere ({external_setting(cfg.server)}); use "
                              "mode.reload=inplace, or drop server.external_url(s)")

    def server_launch(self, ctx: SyncContext) -> ServerLaunch:
        return ServerLaunch(Path(ctx.resume_weights or ctx.model_dir))

    def serve_initial_weights(self) -> None:
        self.served_dir = self.server_launch(self.ctx).model
        if self.server.external and self.ctx.resume_weights:
            # An attached server still serves whatever it had: load the checkpoint's weights into it.
            self.server.each(lambda replica: replica.client.reload_weights(str(self.served_dir), version=self.version))

    def restore_replica(self, replica: Replica) -> None:
        # In-place reloads leave the server's command line on the initial weights; restart on the served ones.
        replica.process.restart(model=self.served_dir, weight_version=self.version)

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        background = self.reload == "background"
        waited = self.settle()  # background: the previous reload lands (or is redone) before a new one starts
        # Not fsynced: served weights are rewritten from the trainer's at every sync (checkpoints are durable).
        out = save_and_load(
            self, "served_weights", lambda d: save_full_weights(model, self.ctx.tokenizer, d, durable=False),
            self._reload_in_background if background else self._serve_weights, step,
        )
        if not background:
            return out
        # sync/seconds: the trainer's own wait; the reload itself ran beside the previous batch's training.
        return {**out, "sync/seconds": out["sync/seconds"] + waited, "sync/reload_wait_seconds": waited,
                "sync/background_load_seconds": self._last_reload_s}

    # ------------------------------------------------------------------ reload=background
    def _reload_in_background(self, out: Path, version: int) -> dict[str, float]:
        """Hand the in-place reload of `out` to the reload thread; a restart from now on serves `out` (the version
        the trainer reports)."""
        self.served_dir = out
        self._landed.clear()
        self._pending = (out, version, self._reloader.submit(self._timed_reload, out, version))
        return {"sync/inplace": 1.0}

    def _timed_reload(self, out: Path, version: int) -> float:
        t0 = time.perf_counter()
        try:
            self.server.each(lambda replica: replica.client.reload_weights(str(out), version=version))
            return time.perf_counter() - t0
        finally:
            self._landed.set()

    def settle(self) -> float:
        """Wait for the background reload in flight; one that failed is redone here through the in-place path
        (a dead or hung server is restarted, bounded). Returns the seconds waited; 0 when none is in flight."""
        if self._pending is None:
            return 0.0
        out, version, future = self._pending
        t0 = time.perf_counter()
        try:
            self._last_reload_s = future.result()
            self.record_stall(self._last_reload_s)  # the engine ran the reload between its steps
            prune(self.ctx.run_dir, "served_weights", keep={out})
        except InferenceServerError as error:
            log.warning("background reload of %s failed (%s); reloading it on the trainer's thread", out, error)
            self._serve_weights(out, version)
        finally:
            self._pending = None
        return time.perf_counter() - t0

    def await_served_weights(self) -> None:
        """Generation samples the weights of the version the server reports: it waits for a background reload in
        flight (on the trainer's own thread, an evaluation, it is settled: redone if it failed)."""
        if threading.get_ident() == self._owner:
            self.settle()
        else:  # the producer's thread: set (no wait) unless a reload is in flight
            self._landed.wait()

    def detach(self) -> bool:
        """A background reload in flight ends before its server is stopped; a server it did not finish loading in
        time is never kept."""
        landed = self._landed.wait(timeout=60)
        if self._reloader is not None:
            self._reloader.shutdown(wait=False, cancel_futures=True)
        return landed

    def _serve_weights(self, out: Path, version: int) -> dict[str, float]:
        """Every replica serves `out` at `version`: reloaded in place (all at once), or restarted on it."""
        if self.reload == "restart":  # background redoes a failed reload in place
            self._restart_on(out, version)
            inplace = False
        else:
            # The engines run the reload between their steps: generation stalls that long; requests in flight are
            # preempted by the prefix-cache reset and go on with the new weights (none is lost).
            with self.stalling():
                errors = self.server.each(lambda replica: self._try_reload(replica, out, version))
            # Here, not in the reload threads: a server restarted there would get SIGTERM once its thread ended.
            inplace = all([self._redo_reload(replica, out, version, error)
                           for replica, error in zip(self.server.replicas, errors) if error is not None])
        self.served_dir = out
        prune(self.ctx.run_dir, "served_weights", keep={out})
        return {"sync/inplace": float(inplace)}

    @staticmethod
    def _try_reload(replica: Replica, out: Path, version: int) -> InferenceServerError | None:
        """`replica` reloads `out` in place: None, or the error of a replica this run launched."""
        try:
            replica.client.reload_weights(str(out), version=version)
            return None
        except InferenceServerError as error:
            if replica.process is None:
                raise  # started elsewhere: nothing we can restart
            return error

    def _redo_reload(self, replica: Replica, out: Path, version: int, error: InferenceServerError) -> bool:
        """After `replica` failed to reload `out`: one that died or hung is restarted alone on the served weights like
        any crash (counted in server/restarts, bounded by server.max_restarts) and reloaded (True); one that still
        refuses is restarted on `out` (False)."""
        self.server.check_health()
        try:
            with self.stalling():
                replica.client.reload_weights(str(out), version=version)
            return True
        except InferenceServerError:
            log.warning("in-place reload of %s on replica %d failed (%s); restarting it on them", out, replica.index,
                        error)
        # The restart drains first: rollouts in flight finish on the old server, new ones wait for the new one.
        with self.stalling(drain=True):
            replica.process.restart(model=out, weight_version=version)
        return False

    def _restart_on(self, out: Path, version: int) -> None:
        if self.server.external:
            raise RuntimeError("mode=none with reload=restart needs servers this trainer launched")
        # The restart drains first: rollouts in flight finish on the old servers, new ones wait for the new ones.
        with self.stalling(drain=True):
            self.server.restart(model=out, weight_version=version)

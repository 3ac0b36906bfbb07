"""The run's inference server from start to stop, serving the weights of one weight sync.

`ServerSession` owns the server's lifecycle: what it launches with (the sync's declared `ServerLaunch` in this run:
served names, a sweep's reuse key), the early start (`server.launch_early`), the launch or attach, the reset of a
server a sweep's job before kept, the endpoint generation samples from and the stop (or keep, for a sweep's next
job); a replica that dies is the server's to restart (`InferenceServer.recover`, which the trainer calls as
`sync.server.recover`). The weight sync (`WeightSync`, a `grpo.sync` strategy) only declares what its mode needs and
moves weights: the session hands it the server (`attach`) and asks it to put weights in place where only it knows
which (the initial weights once the server is up, those of a reset, those of a restarted replica).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

from grpo.config_values import option
from grpo.inference.client import Endpoint, InferenceServerError
from grpo.serving.gate import GenerationGate
from grpo.serving.kept import server_key
from grpo.serving.server import InferenceServer, ServedWeights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLaunch:
    """What a mode's server starts with (`WeightSync.server_launch`): the weights it loads, adapters preloaded, extra
    environment and flags."""

    model: Path
    lora_modules: Mapping[str, Path] | None = None
    env: Mapping[str, str] | None = None
    extra_args: Sequence[str] = ()


class LaunchContext(Protocol):
    """Where the run lives and what it serves first (grpo.sync.base.SyncContext is one)."""

    run_dir: Path
    # HF-format directory of the initial weights; also the name requests use for the served model.
    model_dir: Path
    # The `server` config node (grpo.schema.ServerConfig).
    server_cfg: Any
    # Weights to serve first when resuming; None = model_dir.
    resume_weights: Optional[Path]
    # A sweep's job (server.reuse_across_jobs): take the server the job before kept, and keep it for the next one.
    reuse_server: bool


class WeightSync(ServedWeights, Protocol):
    """What the session asks of the weight sync it serves (grpo.sync.base.SyncStrategy)."""

    mode_name: str
    uses_lora: bool
    reuses_server: bool

    @property
    def served_model(self) -> str | None:
        """The model name requests ask for (an adapter's in LoRA modes); None = the server's default."""

    def server_launch(self, ctx: Any) -> ServerLaunch | None:
        """What the server starts with; None when this sync serves nothing (torchrun ranks > 0)."""

    def attach(self, server: InferenceServer, ctx: Any) -> None:
        """The server the sync moves weights to, and the run it serves."""

    def serve_initial_weights(self) -> None:
        """Once the server is up: put in place what its command line does not load (a resumed adapter, the NCCL
        group of mode=broadcast)."""

    def reset_served_weights(self, model: Path) -> None:
        """A server a sweep's job before kept: serve the initial weights `model` again at this job's version."""

    def await_served_weights(self) -> None:
        """Before a generation reads the endpoint: a weight update still landing (a background reload) lands."""

    def detach(self) -> bool:
        """Before the server stops or is kept: let go of it; False when it must not be kept for the next job."""


class ServerSession:
    """The run's server (`server`, an `InferenceServer`) over its whole life, serving `weights`' weights; see the
    module docstring. Built by the run's build (grpo.build), which starts, launches and stops it."""

    def __init__(self, weights: WeightSync, ctx: LaunchContext) -> None:
        self.weights, self.ctx = weights, ctx
        self.server = InferenceServer()
        weights.attach(self.server, ctx)

    @property
    def gate(self) -> GenerationGate:
        """The gate generation goes through and a restarting sync drains (grpo.serving.gate)."""
        return self.server.gate

    @property
    def started_here(self) -> bool:
        """True when this run started the server's processes (not attached to, nor taken from a sweep's job before)."""
        return bool(self.server.replicas) and not (self.server.external or self.server.reused)

    def start_early(self) -> bool:
        """Start the server's processes now, without waiting for them (`server.launch_early`): the trainer's own
        start-up runs while vLLM starts, and `launch` then waits for the processes started here. False when nothing
        was started: a sync that serves nothing, servers started elsewhere, a server a sweep's job before kept
        (`launch` takes it)."""
        spec = self.weights.server_launch(self.ctx)
        if spec is None:
            return False
        return self.server.start_early(**self._launch_arguments(spec))

    def launch(self) -> None:
        """Start (or attach to, or take from a sweep's job before) the server on the initial weights, waiting for a
        server `start_early` started; then the sync puts in place what the command line does not load. A taken
        server is reset to the initial weights; one whose reset fails is stopped and a new one started."""
        spec = self.weights.server_launch(self.ctx)
        if spec is None:
            return
        launch = functools.partial(self.server.launch, **self._launch_arguments(spec))
        launch()
        if self.server.reused:
            try:
                self.weights.reset_served_weights(spec.model)
                log.info("reusing the vLLM server of the previous job (weights reset to the initial model)")
            except InferenceServerError as error:  # the kept server broke: this job gets a new one
                log.warning("resetting the vLLM server of the previous job failed (%s); starting a new one", error)
                self.server.shutdown()
                launch()  # nothing is kept now: a start-up
        self.weights.serve_initial_weights()

    def _launch_arguments(self, spec: ServerLaunch) -> dict[str, Any]:
        """`InferenceServer.launch`'s (and `start_early`'s) arguments for `spec` in this run."""
        ctx, weights = self.ctx, self.weights
        # A stable name across restarts and weight directories, so requests never need to change it; then the
        # aliases in server.served_model_aliases (e.g. model.name) that Atropos environments may ask for.
        served_names = [str(ctx.model_dir), *(option(ctx.server_cfg, "served_model_aliases", None) or [])]
        reuse_key = None
        if ctx.reuse_server and weights.reuses_server and ctx.resume_weights is None:
            reuse_key = server_key(mode=weights.mode_name, model=str(spec.model), server=ctx.server_cfg,
                                   lora_modules={k: str(v) for k, v in (spec.lora_modules or {}).items()},
                                   enable_lora=weights.uses_lora, env=dict(spec.env or {}),
                                   extra_args=list(spec.extra_args), served_names=served_names)
        return dict(server_cfg=ctx.server_cfg, weights=weights, model=spec.model, run_dir=Path(ctx.run_dir),
                    lora_modules=spec.lora_modules, enable_lora=weights.uses_lora, env=spec.env,
                    extra_args=spec.extra_args, served_names=served_names, reuse_key=reuse_key)

    def endpoint(self) -> Endpoint:
        """The server a pipeline or evaluator samples the current policy from (read it anew for every request
        batch: a restart may move the server and a sync advances the version)."""
        self.weights.await_served_weights()
        return self.server.endpoint(self.weights.served_model, int(self.weights.version))

    def shutdown(self, keep: bool = False) -> None:
        """The sync lets go of the server, then every process the server started stops. Safe to call twice. `keep`
        (a sweep's job that completed): keep the server for the next job when it may be (InferenceServer.shutdown)."""
        may_keep = False
        try:
            may_keep = self.weights.detach()
        finally:
            self.server.shutdown(keep=keep and may_keep)

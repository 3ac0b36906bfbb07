"""The inference server a run samples from: the vLLM replicas it launched, or the one it attached to.

It owns their processes (launch, health check, bounded restart, shutdown), says where requests go (`endpoint`), and
holds the generation gate that a weight sync closes while it takes a replica away. What a replica serves is the
weight sync's business: the server asks the sync that drives it (`ServedWeights`) for the weight version and to bring
a restarted replica back to the current weights. One replica today; `replicas` is a list so that several can be held
(issue 42), and the accessors that assume one (`replica`, `url`, `client`, `process`) refuse when there are more.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from grpo import faults
from grpo.config_values import ConfigError, option
from grpo.inference.client import Endpoint, InferenceClient, InferenceServerError, ServerUnreachable
from grpo.inference.process import VLLMServer
from grpo.serving.gate import GenerationGate

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """One vLLM server: a process this run launched, or one started elsewhere (`server.external_url`: never
    restarted or stopped here). `client` carries the launched server's run token (its weight-changing calls)."""

    client: InferenceClient
    process: VLLMServer | None = None
    external_url: str | None = None

    @property
    def url(self) -> str:
        """http://host:port (no /v1); a launched server keeps its port across restarts."""
        return self.process.url if self.process is not None else str(self.external_url)


class ServedWeights(Protocol):
    """What the server needs from the weight sync that drives it."""

    # The weight version the replicas serve (the trainer's, once a sync has landed).
    version: int

    def restore_replica(self, replica: Replica) -> None:
        """Restart `replica`, found dead or hung, on the weights it served, and put back what lives outside its
        command line (a hot-swapped adapter, a shared weight mapping)."""


class InferenceServer:
    """The vLLM replicas of a run (one today) and everything about their processes; see the module docstring."""

    # A hung (stopped, deadlocked) server accepts the connection but never answers; this bounds the wait.
    health_timeout_s: float = 10.0

    def __init__(self) -> None:
        self.replicas: list[Replica] = []
        # Rollouts generate through it (PipelineContext.generation_gate); restarting syncs drain and hold it.
        self.gate = GenerationGate()
        # Restarts of a dead or hung replica so far in this session (`server/restarts` in every metrics row).
        self.restarts = 0
        self._cfg: Any = None
        self._weights: ServedWeights | None = None

    # ------------------------------------------------------------------ launch
    def launch(
        self, server_cfg: Any, weights: ServedWeights, *, model: Path, run_dir: Path, served_names: Sequence[str],
        lora_modules: Mapping[str, Path] | None = None, enable_lora: bool = False,
        env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
    ) -> None:
        """Start a vLLM server on `model` (the `server` config node `server_cfg`; its log in
        `<run_dir>/logs/vllm.log`), or attach to `server.external_url`, serving `weights.version`."""
        self._cfg, self._weights = server_cfg, weights
        external = option(server_cfg, "external_url")
        if external:
            self.replicas = [self._attach(external, weights.version)]
            return
        process = VLLMServer(
            model, server_cfg, log_path=Path(run_dir) / "logs" / "vllm.log", lora_modules=lora_modules,
            extra_args=extra_args, enable_lora=enable_lora, served_model_name=list(served_names),
            weight_version=weights.version, env=env,
        )
        process.start()
        self.replicas = [Replica(InferenceClient(process.url, token=process.token), process)]  # token: weight calls

    def _attach(self, external: str, version: int) -> Replica:
        url = external.rstrip("/").removesuffix("/v1")
        # A server started with a run token (GRPO_SERVER_TOKEN in its environment) needs it for weight calls.
        client = InferenceClient(url, token=os.environ.get("GRPO_SERVER_TOKEN"))
        if not client.health():  # the user's URL: a message, not a traceback
            raise ConfigError(f"server.external_url={external} does not answer /health: start that server first "
                              "(grpo-serve <vLLM args>), or drop server.external_url and the run starts its own")
        served = client.weight_version()
        if served != version:
            # Rollouts carry the server's versions and the trainer compares them with its own (staleness): one
            # scale. A server attached from an earlier run may count from elsewhere.
            log.info("attached server reports weight version %d; setting it to the run's %d", served, version)
            client.set_weight_version(version)
        return Replica(client, external_url=url)

    # ------------------------------------------------------------------ the one replica of today
    @property
    def replica(self) -> Replica:
        """The run's replica (one today; several are issue 42's)."""
        if not self.replicas:
            raise RuntimeError("inference server not launched")
        if len(self.replicas) > 1:
            raise RuntimeError(f"{len(self.replicas)} replicas: this call serves one; address each replica")
        return self.replicas[0]

    @property
    def url(self) -> str:
        """Base URL of the replica (http://host:port)."""
        return self.replica.url

    @property
    def client(self) -> InferenceClient:
        """The replica's client (with the run token of a server this run launched)."""
        return self.replica.client

    @property
    def process(self) -> VLLMServer | None:
        """The replica's process; None when it was started elsewhere or none is launched."""
        return self.replica.process if self.replicas else None

    @property
    def external(self) -> bool:
        """True when the server was started elsewhere (`server.external_url`): never restarted or stopped here."""
        return any(replica.process is None for replica in self.replicas)

    def endpoint(self, model: str | None, version: int) -> Endpoint:
        """Where to sample `model` (None = the server's default) served at weight `version`."""
        return Endpoint(base_url=self.url, model=model, version=version)

    def restart(self, *, weight_version: int, model: Path | None = None,
                lora_modules: Mapping[str, Path] | None = None) -> None:
        """Restart every replica on `model` and/or with `lora_modules` preloaded, reporting `weight_version` (a sync
        whose weights load only at start-up). Replicas started elsewhere cannot be: RuntimeError."""
        for replica in self.replicas:
            if replica.process is None:
                raise RuntimeError(f"the inference server at {replica.url} was started elsewhere "
                                   "(server.external_url): this run cannot restart it")
            replica.process.restart(model=model, lora_modules=lora_modules, weight_version=weight_version)

    # ------------------------------------------------------------------ health
    def prepare_step(self, step: int) -> None:
        """Before optimizer step `step` (1-based): make sure every replica is up (restart a dead one, bounded)."""
        # GRPO_FAULT (tests) kills or stops our server here, so the health check below must notice.
        for replica in self.replicas:
            faults.server_faults(step, replica.process.pid if replica.process is not None else None)
        self.check_health()

    def check_health(self) -> bool:
        """Restart a dead or unresponsive replica on the current weights, up to server.max_restarts times in the
        run; raise after that. True when it restarted one, False when all were healthy."""
        restarted = False
        for replica in self.replicas:
            restarted = self._check_replica(replica) or restarted
        return restarted

    def _check_replica(self, replica: Replica) -> bool:
        process = replica.process
        if process is None:
            if not replica.client.health():
                raise RuntimeError(f"external inference server {replica.url} is not healthy")
            return False
        if process.healthy(timeout=self.health_timeout_s):
            return False
        limit = int(option(self._cfg, "max_restarts", 3))
        state = "exited" if not process.running() else f"not answering /health within {self.health_timeout_s:g}s"
        tail = process.log_tail(40)
        if self.restarts >= limit:
            raise RuntimeError(
                f"inference server {state}; giving up after {limit} restarts (server.max_restarts={limit}). "
                f"Log {process.log_path}, tail:\n{tail}"
            )
        self.restarts += 1
        log.warning("inference server %s; restart %d of %d on weight version %d", state, self.restarts, limit,
                    self._weights.version)
        self._weights.restore_replica(replica)
        return True

    def recover(self, error: BaseException) -> bool:
        """`error` interrupted generation or a sync: when it means a replica died, restart it (bounded) and return
        True so the caller retries; False when the error is not the server's (the caller re-raises it)."""
        # A server error while the server answers /health is not a crash: the caller re-raises it. Except when the
        # server did not answer at all and answers now: it was restarted meanwhile (asynchronous rollouts: the
        # step's health check, or a restarting sync, ran while the producer's requests failed), so retry.
        if not self.replicas or not isinstance(error, InferenceServerError):
            return False
        return self.check_health() or isinstance(error, ServerUnreachable)

    def shutdown(self) -> None:
        """Stop every process this server launched and close the clients. Safe to call twice."""
        for replica in self.replicas:
            if replica.process is not None:
                replica.process.stop()
            replica.client.close()

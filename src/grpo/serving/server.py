"""The inference server a run samples from: the vLLM replicas it launched, or those it attached to.

It owns their processes (launch, health check, bounded restart of a dead replica alone, shutdown), says where
requests go (`endpoint`: every replica that serves, and the load they share, grpo.inference.routing), and holds the
generation gate that a weight sync closes while it takes the replicas away. What a replica serves is the weight
sync's business: the server asks the sync that drives it (`ServedWeights`) for the weight version and to bring a
restarted replica back to the current weights. `server.replicas=N` launches N vLLM processes, each on its own port
(`server.port` + i when fixed) and device (`server.devices[i]`); `server.external_urls` attaches to N started
elsewhere. The accessors that assume one replica (`replica`, `url`, `client`, `process`) refuse when there are more:
a sync addresses each replica (`replicas`, `each`). Why N processes and not vLLM's own data parallelism:
docs/replicas.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeVar

import requests

from grpo import faults
from grpo.config_values import ConfigError, option
from grpo.inference.client import Endpoint, InferenceClient, InferenceServerError, ServerUnreachable
from grpo.inference.process import VLLMServer
from grpo.inference.routing import ReplicaLoad
from grpo.schema import ServerConfig
from grpo.serving import kept
from grpo.serving.gate import GenerationGate

log = logging.getLogger(__name__)

T = TypeVar("T")


def external_urls(server_cfg: Any) -> list[str]:
    """The URLs of the servers started elsewhere that the run attaches to (`server.external_urls`, or the one of
    `server.external_url`), without a trailing /v1; empty when the run launches its own."""
    urls = option(server_cfg, "external_urls") or ([option(server_cfg, "external_url")]
                                                   if option(server_cfg, "external_url") else [])
    return [str(u).rstrip("/").removesuffix("/v1") for u in urls]


def external_setting(server_cfg: Any) -> str:
    """The setting that names the servers started elsewhere, for messages: `server.external_url=...` or
    `server.external_urls=[...]`."""
    urls = option(server_cfg, "external_urls")
    if urls:
        return f"server.external_urls=[{','.join(str(u) for u in urls)}]"
    return f"server.external_url={option(server_cfg, 'external_url')}"


def replica_count(server_cfg: Any) -> int:
    """How many replicas the `server` config asks for: one per external URL, else `server.replicas`."""
    return len(external_urls(server_cfg)) or int(option(server_cfg, "replicas", ServerConfig.replicas) or 1)


def replica_config(server_cfg: Any, index: int) -> Any:
    """The `server` config of replica `index`: its port (`server.port` + index when fixed) and its device
    (`server.devices[index]`, else `server.device`). Replica 0 of a single-replica run keeps the node itself."""
    devices = option(server_cfg, "devices")
    if index == 0 and not devices:
        return server_cfg
    if dataclasses.is_dataclass(server_cfg):
        values = dataclasses.asdict(server_cfg)
    elif isinstance(server_cfg, Mapping):
        values = dict(server_cfg)
    else:  # an OmegaConf node
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(server_cfg, resolve=True)
    if values.get("port") is not None:
        values["port"] = int(values["port"]) + index
    if devices:
        values["device"] = int(devices[index])
    return values


def replica_log(run_dir: Path, index: int) -> Path:
    """Replica `index`'s vLLM log: `logs/vllm.log` for the first (its pid beside it in `logs/vllm.pid`, where the
    fault injection and `grpo-stop` look), `logs/vllm-replica<i>.log` for the others."""
    return Path(run_dir) / "logs" / ("vllm.log" if index == 0 else f"vllm-replica{index}.log")


@dataclass
class Replica:
    """One vLLM server: a process this run launched, or one started elsewhere (`server.external_url`: never
    restarted or stopped here). `client` carries the launched server's run token (its weight-changing calls)."""

    client: InferenceClient
    process: VLLMServer | None = None
    external_url: str | None = None
    # Position in the run's replicas (the `i` of its metrics, `server/replica<i>/...`).
    index: int = 0
    # False while the server restarts it: requests go to the other replicas meanwhile.
    available: bool = True
    # Restarts of this replica in this session.
    restarts: int = 0

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
    """The vLLM replicas of a run and everything about their processes; see the module docstring."""

    # A hung (stopped, deadlocked) server accepts the connection but never answers; this bounds the wait.
    health_timeout_s: float = 10.0
    # How long a replica that does not answer /health but keeps working (`VLLMServer.busy`: its API process uses
    # CPU, unlike a stopped or deadlocked one) is waited for before it is restarted as hung.
    busy_grace_s: float = 300.0

    def __init__(self) -> None:
        self.replicas: list[Replica] = []
        # Rollouts generate through it (the run's grpo.pipeline.generation.GenerationHandle); restarting syncs drain and hold it.
        self.gate = GenerationGate()
        # Restarts of a dead or hung replica so far in this session (`server/restarts` in every metrics row).
        self.restarts = 0
        # Generation requests in flight and sent, per replica URL: every router of the run shares it.
        self.load = ReplicaLoad()
        # One health check at a time: a sync's replicas (`each`) and the producer thread may ask together, and a
        # dead replica must be restarted once.
        self._health_lock = threading.Lock()
        self._cfg: Any = None
        self._weights: ServedWeights | None = None
        # What the replicas serve (grpo.serving.kept.server_key) when they may be kept for a sweep's next job; None =
        # stopped at shutdown. `reused`: they were kept by the job before (their weights are the sync's to reset).
        self._reuse_key: str | None = None
        self.reused = False
        # Each process's command line as launched or taken over: one restarted on other weights is never kept.
        self._commands: list[list[str]] = []
        self._kept = False
        # Processes `start_early` started and `launch` has not taken yet, with the key of what they serve.
        self._early: tuple[str, list[VLLMServer]] | None = None

    # ------------------------------------------------------------------ launch
    def start_early(
        self, server_cfg: Any, weights: ServedWeights, *, model: Path, run_dir: Path, served_names: Sequence[str],
        lora_modules: Mapping[str, Path] | None = None, enable_lora: bool = False,
        env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (), reuse_key: str | None = None,
    ) -> bool:
        """Start the processes that `launch` with the same arguments starts, without waiting for them: `launch`
        then waits for these. False when `launch` would start none: servers started elsewhere
        (`server.external_url(s)`), or the server a sweep's job before kept under `reuse_key` (`launch` takes it). A
        kept server of other settings is stopped first (it may hold the port)."""
        if external_urls(server_cfg) or kept.holds(reuse_key):
            return False
        kept.take(None)
        processes = self._new_processes(server_cfg, weights, model, run_dir, served_names, lora_modules, enable_lora,
                                        env, extra_args)
        self._start(processes)
        self._early = (self._early_key(server_cfg, weights, model, served_names, lora_modules, enable_lora, env,
                                       extra_args), processes)
        return True

    @staticmethod
    def _early_key(server_cfg: Any, weights: ServedWeights, model: Path, served_names: Sequence[str],
                   lora_modules: Mapping[str, Path] | None, enable_lora: bool, env: Mapping[str, str] | None,
                   extra_args: Sequence[str]) -> str:
        return kept.server_key(model=str(model), server=server_cfg, served_names=list(served_names),
                               lora_modules={k: str(v) for k, v in (lora_modules or {}).items()},
                               enable_lora=enable_lora, env=dict(env or {}), extra_args=list(extra_args),
                               version=weights.version)

    def _take_early(self, key: str) -> list[VLLMServer] | None:
        """The processes `start_early` started when they serve `key`; None otherwise, after stopping any it started
        (a caller that changed what it launches in between)."""
        early, self._early = self._early, None
        if early is None:
            return None
        if early[0] != key:
            log.warning("the vLLM server started early was started with other settings than the launch asks for; "
                        "stopping it and starting the one asked for")
            for process in early[1]:
                process.stop()
            return None
        return early[1]

    def _new_processes(self, server_cfg: Any, weights: ServedWeights, model: Path, run_dir: Path,
                       served_names: Sequence[str], lora_modules: Mapping[str, Path] | None, enable_lora: bool,
                       env: Mapping[str, str] | None, extra_args: Sequence[str]) -> list[VLLMServer]:
        return [
            VLLMServer(model, replica_config(server_cfg, i), log_path=replica_log(run_dir, i),
                       lora_modules=lora_modules, extra_args=extra_args, enable_lora=enable_lora,
                       served_model_name=list(served_names), weight_version=weights.version, env=env)
            for i in range(replica_count(server_cfg))
        ]

    @staticmethod
    def _start(processes: list[VLLMServer]) -> None:
        """Start `processes` side by side without waiting; when one fails to start, stop them all and raise."""
        try:
            # All from this thread: a server gets SIGTERM when the thread that started it ends.
            for process in processes:
                process.start(wait=False)
        except BaseException:
            for process in processes:
                process.stop()
            raise

    def launch(
        self, server_cfg: Any, weights: ServedWeights, *, model: Path, run_dir: Path, served_names: Sequence[str],
        lora_modules: Mapping[str, Path] | None = None, enable_lora: bool = False,
        env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (), reuse_key: str | None = None,
    ) -> None:
        """Start `server.replicas` vLLM servers on `model` at once (the `server` config node `server_cfg`; replica
        i's log in `replica_log(run_dir, i)`), or attach to `server.external_urls` / `server.external_url`, serving
        `weights.version`. When one fails to start, those started are stopped and the error raised. `reuse_key`
        (a sweep's job, grpo.serving.kept): take the server the job before kept under that key instead of starting
        one (`reused`: its weights are the caller's to reset), and let `shutdown(keep=True)` keep it for the next."""
        self._cfg, self._weights = server_cfg, weights
        urls = external_urls(server_cfg)
        taken = kept.take(reuse_key if not urls else None)  # a kept server of other settings is stopped here
        self._reuse_key, self.reused = (reuse_key if not urls else None), taken is not None
        if urls:
            self.replicas = [self._attach(url, weights.version, i) for i, url in enumerate(urls)]
            return
        if taken is not None:
            try:
                for i, process in enumerate(taken):
                    process.move_records(replica_log(run_dir, i))
            except BaseException:
                kept.stop(taken)
                raise
            self._adopt(taken)
            return
        processes = self._take_early(self._early_key(server_cfg, weights, model, served_names, lora_modules,
                                                     enable_lora, env, extra_args))
        if processes is None:
            processes = self._new_processes(server_cfg, weights, model, run_dir, served_names, lora_modules,
                                            enable_lora, env, extra_args)
            self._start(processes)
        try:
            for process in processes:
                process.wait_started()
        except BaseException:
            for process in processes:
                process.stop()
            raise
        self._adopt(processes)

    def _adopt(self, processes: list[VLLMServer]) -> None:
        # token: the weight-changing calls of a server this run launched need it.
        self.replicas = [Replica(InferenceClient(p.url, token=p.token), p, index=i) for i, p in enumerate(processes)]
        self._commands, self._kept = [p.command() for p in processes], False

    def _attach(self, url: str, version: int, index: int) -> Replica:
        # A server started with a run token (GRPO_SERVER_TOKEN in its environment) needs it for weight calls.
        client = InferenceClient(url, token=os.environ.get("GRPO_SERVER_TOKEN"))
        key = "external_url" if option(self._cfg, "external_url") else "external_urls"
        if not client.health():  # the user's URL: a message, not a traceback
            raise ConfigError(f"server.{key}={url} does not answer /health: start that server first "
                              f"(grpo-serve <vLLM args>), or drop server.{key} and the run starts its own")
        try:  # the handshake: something else answering /health (a plain vLLM server) fails later with a traceback
            client.server_info()
        except (InferenceServerError, requests.RequestException) as e:
            raise ConfigError(f"server.{key}={url} answers /health but is not a grpo server ({e}); start it with "
                              f"grpo-serve <vLLM args>, not vllm serve or another server") from None
        served = client.weight_version()
        if served != version:
            # Rollouts carry the server's versions and the trainer compares them with its own (staleness): one
            # scale. A server attached from an earlier run may count from elsewhere.
            log.info("attached server %s reports weight version %d; setting it to the run's %d", url, served, version)
            client.set_weight_version(version)
        return Replica(client, external_url=url, index=index)

    # ------------------------------------------------------------------ the accessors of one replica
    @property
    def replica(self) -> Replica:
        """The run's replica, when it has one (a call that must reach every replica uses `replicas` or `each`)."""
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
        """True when the replicas were started elsewhere (`server.external_url(s)`): never restarted or stopped."""
        return any(replica.process is None for replica in self.replicas)

    # ------------------------------------------------------------------ every replica
    def each(self, call: Callable[[Replica], T]) -> list[T]:
        """`call(replica)` for every replica at once (a weight load, an RPC), in threads of its own; their results in
        replica order. The first error is raised once every call has ended. Never a call that starts a server: it
        gets SIGTERM when the thread that started it ends."""
        if len(self.replicas) <= 1:
            return [call(replica) for replica in self.replicas]
        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="grpo-replica") as pool:
            futures = [pool.submit(call, replica) for replica in self.replicas]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def endpoint(self, model: str | None, version: int) -> Endpoint:
        """Where to sample `model` (None = the server's default) served at weight `version`: every replica that
        serves now (not one being restarted), and the load they share."""
        serving = [r.url for r in self.replicas if r.available] or [r.url for r in self.replicas]
        if not serving:
            raise RuntimeError("inference server not launched")
        return Endpoint(base_url=serving[0], model=model, version=version, replica_urls=tuple(serving),
                        load=self.load)

    def restart(self, *, weight_version: int, model: Path | None = None,
                lora_modules: Mapping[str, Path] | None = None) -> None:
        """Restart every replica (side by side) on `model` and/or with `lora_modules` preloaded, reporting
        `weight_version` (a sync whose weights load only at start-up). Replicas started elsewhere cannot be:
        RuntimeError."""
        for replica in self.replicas:
            if replica.process is None:
                raise RuntimeError(f"the inference server at {replica.url} was started elsewhere "
                                   "(server.external_url(s)): this run cannot restart it")
        # Side by side, all from this thread: a server gets SIGTERM when the thread that started it ends.
        for replica in self.replicas:
            replica.process.restart(model=model, lora_modules=lora_modules, weight_version=weight_version, wait=False)
        for replica in self.replicas:
            replica.process.wait_started()

    def metrics(self) -> dict[str, float]:
        """`server/restarts` so far in this session and, with several replicas, each one's generation requests
        sent (`server/replica<i>/requests`, a prompt with its n completions being one) and restarts."""
        out = {"server/restarts": float(self.restarts)}
        if len(self.replicas) > 1:
            out["server/replicas"] = float(len(self.replicas))
            out["server/failovers"] = float(self.load.failovers)
            for replica in self.replicas:
                out[f"server/replica{replica.index}/requests"] = float(self.load.sent.get(replica.url, 0))
                out[f"server/replica{replica.index}/restarts"] = float(replica.restarts)
        return out

    # ------------------------------------------------------------------ health
    def prepare_step(self, step: int) -> None:
        """Before optimizer step `step` (1-based): make sure every replica is up (restart a dead one, bounded)."""
        # GRPO_FAULT (tests) kills or stops our first replica here, so the health check below must notice.
        if self.replicas:
            first = self.replicas[0].process
            faults.server_faults(step, first.pid if first is not None else None)
        self.check_health()

    def check_health(self) -> bool:
        """Restart each dead or unresponsive replica alone on the current weights (the others keep serving), up to
        server.max_restarts times each in this session; raise after that. True when it restarted one, False when all were
        healthy."""
        restarted = False
        with self._health_lock:
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
        if self._still_busy(replica, process):
            return False
        limit = int(option(self._cfg, "max_restarts", ServerConfig.max_restarts))
        state = "exited" if not process.running() else f"not answering /health within {self.health_timeout_s:g}s"
        tail = process.log_tail(40)
        if replica.restarts >= limit:  # each replica's own bound: one that keeps dying does not spend the others'
            raise RuntimeError(
                f"{self._name(replica)} {state}; giving up after {limit} restarts (server.max_restarts={limit}). "
                f"Log {process.log_path}, tail:\n{tail}"
            )
        self.restarts += 1
        replica.restarts += 1
        log.warning("%s %s; restart %d of %d on weight version %d", self._name(replica), state, replica.restarts, limit,
                    self._weights.version)
        replica.available = False  # requests go to the other replicas while it starts
        try:
            self._weights.restore_replica(replica)
        finally:
            replica.available = True
        return True

    def _still_busy(self, replica: Replica, process: VLLMServer) -> bool:
        """True when `process`, not answering /health in time, is busy rather than hung (`VLLMServer.busy`; it is
        asked again until it answers, for at most `busy_grace_s`): a restart would only throw its work away."""
        import time

        deadline = time.monotonic() + self.busy_grace_s
        while process.busy(self.health_timeout_s):  # False once it answers, or is found dead, stopped or idle
            log.warning("%s busy: /health did not answer within %gs, yet its API process works; not restarting it",
                        self._name(replica), self.health_timeout_s)
            if time.monotonic() >= deadline:
                return False
        return process.healthy(timeout=self.health_timeout_s)

    def _name(self, replica: Replica) -> str:
        """How messages name `replica`: "inference server", and which replica when there are several."""
        if len(self.replicas) == 1:
            return "inference server"
        return f"inference server replica {replica.index} ({replica.url})"

    def recover(self, error: BaseException) -> bool:
        """`error` interrupted generation or a sync: when it means a replica died, restart it (bounded) and return
        True so the caller retries; False when the error is not the server's (the caller re-raises it)."""
        # A server error while the server answers /health is not a crash: the caller re-raises it. Except when the
        # server did not answer at all and answers now: it was restarted meanwhile (asynchronous rollouts: the
        # step's health check, or a restarting sync, ran while the producer's requests failed), so retry.
        if not self.replicas or not isinstance(error, InferenceServerError):
            return False
        return self.check_health() or isinstance(error, ServerUnreachable)

    def shutdown(self, keep: bool = False) -> None:
        """Stop every process this server launched and close the clients. Safe to call twice. `keep` (a sweep's job
        that completed): keep the processes for the next job instead (grpo.serving.kept) when they may be: launched
        with a reuse key, never restarted, on the command line they started with, healthy. Processes `start_early`
        started that no launch took (a run that failed before it) are stopped."""
        early, self._early = self._early, None
        for process in early[1] if early is not None else []:
            process.stop()
        for replica in self.replicas:
            replica.client.close()
        processes = [replica.process for replica in self.replicas]
        if self._kept:  # a second call must not stop what the first one kept
            return
        if keep and self.keepable(processes):
            kept.keep(self._reuse_key, processes)
            self._kept = True
            return
        for process in processes:
            if process is not None:
                process.stop()

    def keepable(self, processes: list[VLLMServer | None]) -> bool:
        """Whether `processes` (the replicas' at shutdown) may serve a sweep's next job."""
        if self._reuse_key is None or not processes or any(p is None for p in processes) or self.restarts:
            return False
        return [p.command() for p in processes] == self._commands and all(p.healthy() for p in processes)

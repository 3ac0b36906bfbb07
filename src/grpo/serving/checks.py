"""Checks of `server.*` before the server starts, beside the server they configure: a GPU for server=gpu, knobs in
range, replicas that add up (a device each on a GPU), free ports (or external servers named), and a
`max_model_len` within the model's positions. Each raises ConfigError; vLLM's own refusals came after its
start-up, as tracebacks in its log."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from omegaconf import DictConfig

from grpo.config_values import CheckContext, ConfigError
from grpo.inference.launch_args import parallel_sizes
from grpo.schema import ServerConfig
from grpo.serving import kept
from grpo.serving.server import external_urls, replica_count


def _port_free(host: str, port: int) -> bool:
    """Whether this machine can bind `host:port` now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_server(cfg: DictConfig, choice: str | None, cuda: bool) -> None:
    """The server's ports are free (or external servers are named), its knobs are in range, its replicas add up,
    and `server=gpu` (`choice`, the server group's option) has a GPU to run on."""
    external = bool(external_urls(cfg.server))
    if choice == "gpu" and not external and not cuda:
        # Else vLLM starts on the CPU with the GPU settings and fails on one of them (e.g. max_model_len).
        raise ConfigError("server=gpu runs the vLLM server on a CUDA GPU and none is visible here; use server=cpu "
                          "(the vLLM CPU engine), or attach to a GPU server with server.external_url=http://host:port")
    check_replicas(cfg, choice)
    kv_cache_gb = cfg.server.get("kv_cache_gb")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise ConfigError(f"server.kv_cache_gb must be a positive number of GiB or null, got {kv_cache_gb}")
    if cfg.server.busy_loop_s is not None and cfg.server.busy_loop_s < 0:
        raise ConfigError(f"server.busy_loop_s must be >= 0 seconds or null, got {cfg.server.busy_loop_s}")
    if cfg.server.worker_in_engine_process and max(parallel_sizes(cfg.server.extra_args).values()) > 1:
        raise ConfigError(
            "server.worker_in_engine_process=true runs one vLLM worker, but server.extra_args="
            f"{list(cfg.server.extra_args)} asks for several: set server.worker_in_engine_process=false"
        )
    port_fixed = cfg.server.port is not None  # null: the launcher picks a free port
    replicas = replica_count(cfg.server)
    if port_fixed and not 1 <= cfg.server.port <= 65536 - replicas:
        # Else the bind below fails with Python's OverflowError traceback.
        several = f" (replica i listens on server.port + i, up to {cfg.server.port + replicas - 1})" if replicas > 1 else ""
        raise ConfigError(f"server.port={cfg.server.port} is not a TCP port{several}: use 1-65535, or null to pick "
                          "a free one")
    for port in range(cfg.server.port, cfg.server.port + replicas) if port_fixed and not external else ():
        # A sweep's server kept by the job before: this job's launch takes it, or stops it before starting its own.
        if port not in kept.kept_ports() and not _port_free(cfg.server.host, port):
            where = (f"server.port={cfg.server.port}: port {port} on {cfg.server.host} is already in use (replica i "
                     "listens on server.port + i)") if replicas > 1 else \
                f"server.port={port} on {cfg.server.host} is already in use"
            raise ConfigError(f"{where}; pick a free port (server.port=...) or attach to that server with "
                              "server.external_url=http://host:port")


def check_replicas(cfg: DictConfig, choice: str | None) -> None:
    """`server.replicas` >= 1; `server.external_url` or `server.external_urls`, not both, and as many URLs as
    replicas; `server.devices` one per replica (on a GPU, required for several)."""
    server = cfg.server
    replicas = server.get("replicas", ServerConfig.replicas)
    urls, devices = server.get("external_urls"), server.get("devices")
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"server.replicas must be a whole number >= 1 (vLLM servers to launch), got {replicas}")
    if urls is not None and server.get("external_url"):
        raise ConfigError("set server.external_url (one server started elsewhere) or server.external_urls (several), "
                          f"not both: got {server.external_url} and {list(urls)}")
    if urls is not None:
        if not urls:
            raise ConfigError("server.external_urls is empty: list the servers' URLs, or null to launch servers")
        if replicas not in (1, len(urls)):
            raise ConfigError(f"server.replicas={replicas} but server.external_urls lists {len(urls)} servers: the "
                              "run attaches to one replica per URL; drop server.replicas or make them agree")
        return
    if server.get("external_url") and replicas > 1:
        raise ConfigError(f"server.replicas={replicas} with server.external_url: the run attaches to that one server "
                          "and launches none; list several servers in server.external_urls=[http://h1:p1,...]")
    if devices is not None and len(devices) != replicas:
        raise ConfigError(f"server.devices={list(devices)} names {len(devices)} device(s) for server.replicas="
                          f"{replicas}: give one CUDA index per replica, or null")
    if choice == "gpu" and replicas > 1 and devices is None:
        raise ConfigError(f"server.replicas={replicas} on GPUs needs a GPU per replica: set server.devices "
                          f"(e.g. server.devices=[{', '.join(str(i + 1) for i in range(replicas))}]); replicas sharing "
                          "one GPU would each claim server.gpu_memory_utilization of it")


def check_server_fits_model(cfg: DictConfig, model_dir: str | Path) -> None:
    """`server.max_model_len` within the model's `max_position_embeddings` (its config.json in `model_dir`, once the
    model directory exists): vLLM refuses a longer one, but only after its start-up, with a traceback in its log.
    `server=gpu`'s 4096 against the tiny models' 1024 was the first thing a GPU user of the default job met."""
    max_len = cfg.server.get("max_model_len")
    try:
        positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # not a directory with a readable config: loading the model says what is wrong
    if not external_urls(cfg.server) and max_len is not None and positions and max_len > positions:
        raise ConfigError(
            f"server.max_model_len={max_len} exceeds the model's max_position_embeddings={positions} "
            f"({Path(model_dir) / 'config.json'}), which vLLM refuses: set server.max_model_len={positions} (or less)"
        )


QUANTIZATIONS = ("fp8",)


def check_quantization(cfg: DictConfig, cuda: bool) -> None:
    """`server.quantization=fp8`: vLLM quantizes the served weights itself, so rollouts are sampled from another
    policy than the trainer's. Needs a GPU vLLM launches on (its CPU engine has no FP8 kernels; a server started
    elsewhere has its own settings). The mode's own refusal (`SyncStrategy.quantization_refusal`) is its
    check_config's, the loss's correction of the gap the loss's (grpo.trainer.loss_checks)."""
    quantization = cfg.server.get("quantization")
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"server.quantization={quantization} is not one of {', '.join(QUANTIZATIONS)} (or null: "
                          "the weights served as the trainer has them)")
    extra = [str(a).split("=", 1)[0] for a in cfg.server.get("extra_args") or []]
    if "--quantization" in extra or "-q" in extra:
        raise ConfigError(f"server.quantization={quantization} and --quantization in server.extra_args: set one")
    if external_urls(cfg.server):
        raise ConfigError(f"server.quantization={quantization} sets how the run launches vLLM, but the run attaches "
                          "to a server started elsewhere, with settings of its own: start that server with "
                          "--quantization fp8 and set server.quantization=null")
    if not cuda:
        raise ConfigError(f"server.quantization={quantization} needs vLLM on a CUDA GPU (its CPU engine has no FP8 "
                          "kernels); set server.quantization=null on this machine")


def check_memory_share_used(cfg: DictConfig, ctx: CheckContext) -> None:
    """`server.gpu_memory_utilization` on the command line while `server.kv_cache_gb` sizes the KV cache (server=cpu
    sets it): vLLM ignores the share whenever --kv-cache-memory-bytes is given, so the setting would be silently
    ignored. Not in a sweep, whose settings are common to its jobs (`-m server=cpu,gpu ...`)."""
    given = ctx.given("server.gpu_memory_utilization")
    kv_cache_gb = cfg.server.get("kv_cache_gb")
    if given and kv_cache_gb is not None and not ctx.multirun:
        raise ConfigError(
            f"{given[0]} would be ignored: server.kv_cache_gb={kv_cache_gb} sizes vLLM's KV cache (server=cpu sets "
            "it), and vLLM then ignores the share; set the size with server.kv_cache_gb=<GiB>, or add "
            "server.kv_cache_gb=null to size the cache by the share"
        )

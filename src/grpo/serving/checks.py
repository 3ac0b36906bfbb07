"""Checks of `server.*` before the server starts, beside the server they configure: a GPU for server=gpu, knobs in
range, a free port (or an external server named), and a `max_model_len` within the model's positions. Each raises
ConfigError; vLLM's own refusals came after its start-up, as tracebacks in its log."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from omegaconf import DictConfig

from grpo.config_values import ConfigError
from grpo.inference.process import parallel_sizes


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
    """The server's port is free (or an external server is named), its knobs are in range, and `server=gpu`
    (`choice`, the server group's option) has a GPU to run on."""
    if choice == "gpu" and cfg.server.external_url is None and not cuda:
        # Else vLLM starts on the CPU with the GPU settings and fails on one of them (e.g. max_model_len).
        raise ConfigError("server=gpu runs the vLLM server on a CUDA GPU and none is visible here; use server=cpu "
                          "(the vLLM CPU engine), or attach to a GPU server with server.external_url=http://host:port")
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
    if port_fixed and not 1 <= cfg.server.port <= 65535:
        # Else the bind below fails with Python's OverflowError traceback.
        raise ConfigError(f"server.port={cfg.server.port} is not a TCP port: use 1-65535, or null to pick a free one")
    if cfg.server.external_url is None and port_fixed and not _port_free(cfg.server.host, cfg.server.port):
        raise ConfigError(
            f"server.port={cfg.server.port} on {cfg.server.host} is already in use; pick a free port "
            "(server.port=...) or attach to that server with server.external_url=http://host:port"
        )


def check_server_fits_model(cfg: DictConfig, model_dir: str | Path) -> None:
    """`server.max_model_len` within the model's `max_position_embeddings` (its config.json in `model_dir`, once the
    model directory exists): vLLM refuses a longer one, but only after its start-up, with a traceback in its log.
    `server=gpu`'s 4096 against the tiny models' 1024 was the first thing a GPU user of the default job met."""
    max_len = cfg.server.get("max_model_len")
    try:
        positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # not a directory with a readable config: loading the model says what is wrong
    if cfg.server.get("external_url") is None and max_len is not None and positions and max_len > positions:
        raise ConfigError(
            f"server.max_model_len={max_len} exceeds the model's max_position_embeddings={positions} "
            f"({Path(model_dir) / 'config.json'}), which vLLM refuses: set server.max_model_len={positions} (or less)"
        )

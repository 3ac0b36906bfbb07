"""The vLLM server a sweep's job keeps for the next one (`server.reuse_across_jobs`, docs/sweeps.md).

The jobs of a Hydra multirun under the basic launcher run one after another in one process. At the end of a job
that completed on a healthy server, the server's processes are kept here instead of stopped, under a key that says
what they serve (`server_key`: the initial weights, the server settings, what the mode adds to the command line); the
next job whose key matches takes them and resets what they serve (its weight sync's `reset_served_weights`) instead of
waiting for a new start-up. A job whose key differs stops the kept server before it starts its own; a kept server
that died meanwhile is stopped and replaced. At most one server is kept; the process's exit stops it (atexit, and
the sweep's end through grpo.job.StopKeptServer).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from grpo.inference.process import VLLMServer

log = logging.getLogger(__name__)


@dataclass
class KeptServer:
    """A server's processes kept between jobs, and the key of what they serve."""

    key: str
    processes: list[VLLMServer]


_kept: KeptServer | None = None
_atexit_registered = False


def plain(node: Any) -> Any:
    """A config node (OmegaConf, dataclass or mapping) as plain values, for a key."""
    if node is None or isinstance(node, (str, int, float, bool)):
        return node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return plain(dataclasses.asdict(node))
    if isinstance(node, Mapping):
        return {str(k): plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [plain(v) for v in node]
    try:  # an OmegaConf node
        from omegaconf import OmegaConf

        return plain(OmegaConf.to_container(node, resolve=True))
    except ValueError:
        return str(node)


def server_key(**settings: Any) -> str:
    """The key of a server launched with `settings` (every value that reaches its command line or environment)."""
    # The trainer's visible GPUs decide which devices server.device names.
    settings["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return json.dumps(plain(settings), sort_keys=True, default=str)


def take(key: str | None) -> list[VLLMServer] | None:
    """The kept server's processes when they serve `key` and every one is healthy (no longer kept from here on);
    None otherwise, after stopping whatever was kept (`key` None: a job that launches no server of this kind)."""
    global _kept
    kept, _kept = _kept, None
    if kept is None:
        return None
    if key is None or kept.key != key:
        log.info("stopping the vLLM server kept from the previous job: this job needs another server")
        stop(kept.processes)
        return None
    dead = [p for p in kept.processes if not p.healthy()]
    if dead:
        log.warning("the vLLM server kept from the previous job no longer answers (pid %s); starting a new one",
                    ", ".join(str(p.pid) for p in dead))
        stop(kept.processes)
        return None
    return kept.processes


def keep(key: str, processes: list[VLLMServer]) -> None:
    """Keep `processes` (a healthy server serving `key`) for the next job; whatever was kept before is stopped."""
    global _kept, _atexit_registered
    if _kept is not None:
        stop(_kept.processes)
    _kept = KeptServer(key, list(processes))
    if not _atexit_registered:
        atexit.register(stop_kept)
        _atexit_registered = True
    log.info("vLLM server kept for the next job of the sweep (pid %s)", ", ".join(str(p.pid) for p in processes))


def holds(key: str | None) -> bool:
    """Whether a server is kept under `key` (`take(key)` may give it; False for None)."""
    return key is not None and _kept is not None and _kept.key == key


def kept_ports() -> set[int]:
    """The ports the kept server listens on; empty when none is kept."""
    return {p.port for p in _kept.processes if p.port is not None} if _kept is not None else set()


def kept_pids() -> list[int]:
    """The pids (process groups) of the kept server; empty when none is kept."""
    return [p.pid for p in _kept.processes if p.pid is not None] if _kept is not None else []


def stop_kept() -> None:
    """Stop the kept server, if any (the sweep's end, the process's exit)."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        log.info("stopping the vLLM server kept for the sweep (pid %s)",
                 ", ".join(str(p.pid) for p in kept.processes))
        stop(kept.processes)


def stop(processes: list[VLLMServer]) -> None:
    for process in processes:
        process.stop()

"""The versioned weight directories of the file-based syncs (mode=none, lora_restart, lora_only): each sync saves
the weights into `<run_dir>/<kind>/v<version>`, the server loads them, and older directories are pruned."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable, Mapping

from grpo import faults
from grpo.sync.base import SyncStrategy


def versioned_dir(run_dir: Path, kind: str, version: int) -> Path:
    """Where the weights of `version` go: `<run_dir>/<kind>/v<version>`."""
    return Path(run_dir) / kind / f"v{version}"


def prune(run_dir: Path, kind: str, keep: set[Path]) -> None:
    """Delete old versioned directories except `keep` (the served one and the one being switched to)."""
    root = Path(run_dir) / kind
    if not root.exists():
        return
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("v") and d not in keep:
            shutil.rmtree(d, ignore_errors=True)


def save_and_load(
    sync: SyncStrategy, kind: str, save: Callable[[Path], Path | tuple[Path, Mapping[str, float]]],
    load: Callable[[Path, int], Mapping[str, float] | None], step: int,
) -> dict[str, float]:
    """One sync of a file-based mode: ``save`` the weights into the directory of `sync`'s next version, have the
    server ``load(dir, version)`` them, then advance `sync.version`. Returns the timings every such mode reports plus
    the figures ``save`` returns with the directory (when it does) and whatever ``load`` adds."""
    t0 = time.perf_counter()
    version = sync.version + 1
    saved = save(versioned_dir(sync.ctx.run_dir, kind, version))
    out, figures = saved if isinstance(saved, tuple) else (saved, {})
    t_saved = time.perf_counter()
    process = sync.server.replicas[0].process if sync.server.replicas else None
    if process is not None:  # GRPO_FAULT (tests): the (first) server dies while the sync runs
        faults.kill_server_syncing(step, process.pid_path)
    extra = dict(load(out, version) or {})
    sync.version = version
    t1 = time.perf_counter()
    return {
        "sync/seconds": t1 - t0,
        "sync/save_seconds": t_saved - t0,
        "sync/load_seconds": t1 - t_saved,
        **figures,
        **extra,
        "sync/version": float(version),
    }

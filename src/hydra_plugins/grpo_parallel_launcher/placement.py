"""Which GPUs a sweep's job needs and where it runs now: the placement logic of `hydra/launcher=grpo_parallel`,
kept apart from the processes so that it can be checked on a host without GPUs (a list of GPU ids stands in for
the host's)."""

import os
from typing import List, Optional, Sequence, Tuple

from omegaconf import DictConfig


def job_gpus(cfg: DictConfig, ranks: int = 1) -> int:
    """GPUs one job's layout takes, from its composed config: the trainer's `ranks` processes on GPUs 0..ranks-1
    (FSDP2 under torchrun; 1 otherwise) and its launched servers (`server.device` or `server.devices`, each the first
    of tensor x pipeline x data parallel GPUs; none given: beside the trainer from GPU 0). shared_vllm, or a server
    beside the trainer: 1; broadcast (or none / lora_only / lora_restart) with `server.device=1`: 2; a server
    started elsewhere (`server.external_url(s)`): the trainer's alone."""
    from grpo.inference.launch_args import gpus_per_server

    server = cfg.server
    if server.get("external_url") or server.get("external_urls"):
        return max(1, ranks)
    firsts = [int(d) for d in (server.get("devices") or [])] or (
        [int(server.device)] if server.get("device") is not None else [0])
    per_server = gpus_per_server(server.get("extra_args"))
    return max([1, ranks] + [first + per_server for first in firsts])


def visible_gpus(given: Optional[Sequence[int]]) -> List[str]:
    """The GPU ids the launcher may hand out: `given` (hydra.launcher.gpus), else CUDA_VISIBLE_DEVICES, else every
    GPU torch sees (none on a CPU host)."""
    if given:
        return [str(g) for g in given]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def group_ids(group: str) -> List[str]:
    """The GPU ids of a CUDA_VISIBLE_DEVICES value."""
    return [g for g in group.split(",") if g]


def place(need: int, free: Sequence[str], idle: Sequence[str], order: Sequence[str]) -> Optional[Tuple[str, List[str]]]:
    """Where a job needing `need` GPUs runs now, or None when it must wait for GPUs.

    `free`: GPUs no worker holds; `idle`: the GPU groups of the workers without a job (each keeps its vLLM server for
    a next job of the same settings); `order`: every GPU id in the order the host lists them. Returns (the job's GPU
    group, the idle workers' groups to retire first so that their GPUs come free): an idle worker of exactly `need`
    GPUs first (its server may be the job's), else free GPUs, else free GPUs and those of idle workers retired."""
    for group in idle:
        if len(group_ids(group)) == need:
            return group, []
    rank = {g: i for i, g in enumerate(order)}
    pool, retire = sorted(free, key=rank.__getitem__), []
    for group in [None, *idle]:
        if group is not None:
            retire.append(group)
            pool = sorted(pool + group_ids(group), key=rank.__getitem__)
        if len(pool) >= need:
            return ",".join(pool[:need]), retire
    return None


def check_fits(needs: Sequence[Tuple[int, int]], gpus: Sequence[str]) -> None:
    """Refuse a sweep whose job (index, GPUs it needs) can never fit the GPUs given, before any job starts."""
    for idx, need in needs:
        if need > len(gpus):
            raise ValueError(f"job #{idx} needs {need} GPU(s) (its layout: the trainer's GPU and its server's, or "
                             f"hydra.launcher.gpus_per_job) and {len(gpus)} are given ({','.join(gpus)}); lower "
                             "the layout's GPUs or give more (hydra.launcher.gpus, CUDA_VISIBLE_DEVICES)")

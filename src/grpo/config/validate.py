"""Start-up checks that need more than a schema: run before any model loads, fail with what to change."""

from __future__ import annotations

import importlib
import os
import shutil
import socket
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig

# LoRA ranks vLLM accepts for --max-lora-rank (vllm/config/lora.py).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Below this much free space in the run dir, a full checkpoint of even a small model may not fit.
MIN_FREE_BYTES = 200 * 1024**2


class ConfigError(ValueError):
    """A config that composes but cannot run; the message says which key to change."""


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _check_importable(target: str, key: str, install_hint: str) -> None:
    module = target.rsplit(".", 1)[0]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}={target} needs `{module}`, which is not importable ({e}). {install_hint}") from e


def check_run_dir(run_dir: Path) -> None:
    """The run dir must be writable with room for checkpoints; checked before training starts."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run dir {run_dir} is not writable ({e}); set hydra.run.dir to a writable path") from e
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise ConfigError(
            f"run dir {run_dir} has only {free / 1024**2:.0f} MiB free (need at least "
            f"{MIN_FREE_BYTES / 1024**2:.0f} MiB for checkpoints); free space or set hydra.run.dir elsewhere"
        )


def parallel_sizes(extra_args) -> dict[str, int]:
    """Tensor / pipeline / data parallel sizes given in server.extra_args (1 when absent)."""
    flags = {
        "--tensor-parallel-size": "tensor", "-tp": "tensor",
        "--pipeline-parallel-size": "pipeline", "-pp": "pipeline",
        "--data-parallel-size": "data", "-dp": "data",
    }
    sizes = {"tensor": 1, "pipeline": 1, "data": 1}
    args = [str(a) for a in (extra_args or [])]
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag in flags:
            val = val if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                sizes[flags[flag]] = int(val)
            except ValueError:
                raise ConfigError(f"server.extra_args: {flag} needs an integer, got {val!r}") from None
    return sizes


def check_layout(cfg: DictConfig, sync_cls: type, cuda: bool, world_size: int = 1) -> None:
    """Checks of the multi-GPU layouts: shared_vllm needs one vLLM worker, broadcast needs vLLM on its own GPU,
    and a torchrun (FSDP2) trainer composes with the modes whose sync all ranks can join (`fsdp_gather`:
    mode=none and mode=broadcast)."""
    from grpo.sync.nccl_broadcast import NCCLBroadcastSync
    from grpo.sync.shared_memory import SharedMemorySync

    sizes = parallel_sizes(cfg.server.extra_args)
    if issubclass(sync_cls, SharedMemorySync) and any(v > 1 for v in sizes.values()):
        what = ", ".join(f"{k} parallel {v}" for k, v in sizes.items() if v > 1)
        raise ConfigError(
            f"mode=shared_vllm trains views of one vLLM worker's tensors and does not support vLLM {what} "
            f"(server.extra_args={list(cfg.server.extra_args)}): each rank would hold only a shard. Use "
            "mode=broadcast (trainer on its own GPU, weights sent to every vLLM rank by NCCL; set server.device) "
            "or drop --tensor-parallel-size (tp=1) to keep mode=shared_vllm."
        )
    if issubclass(sync_cls, NCCLBroadcastSync) and not cuda:
        raise ConfigError(
            "mode=broadcast sends weights by NCCL from the trainer's GPU to vLLM's GPU(s) and needs CUDA; none is "
            "visible here. Use mode=none, mode=lora_only or mode=lora_restart on this machine."
        )
    if issubclass(sync_cls, NCCLBroadcastSync) and cuda and cfg.server.external_url is None:
        dev = cfg.server.device
        if dev is None or (isinstance(dev, int) and dev < world_size):
            raise ConfigError(
                f"mode=broadcast needs vLLM on GPUs the trainer does not use (NCCL cannot join two ranks on one "
                f"GPU): set server.device to a GPU index >= {world_size} (server.device={dev}); e.g. trainer on "
                f"GPU 0, server.device=1"
            )
    if world_size > 1 and getattr(sync_cls, "fsdp_gather", None) is None:
        # LoRA modes would need the adapter sharded and saved as an adapter; shared_vllm trains vLLM's own CUDA
        # tensors in place, which cannot be sharded over trainer ranks. Neither is built.
        why = ("shared_vllm trains vLLM's own CUDA tensors in place, which FSDP2 cannot shard"
               if issubclass(sync_cls, SharedMemorySync) else "LoRA adapters are not sharded with FSDP2 here")
        raise ConfigError(
            f"a torchrun trainer ({world_size} processes, FSDP2) composes with mode=none or mode=broadcast, not "
            f"mode={_mode_name(cfg)} ({why}); run it with mode=none, or mode=broadcast server.device=<a GPU index "
            f">= {world_size}>, or run one process for this mode"
        )


def validate(cfg: DictConfig, run_dir: Path | None = None) -> None:
    """Check everything that can be known before loading a model. Raises ConfigError naming the key."""
    from grpo.trainer.layers import resolve_layer_indices

    try:
        resolve_layer_indices(cfg.layers.indices, cfg.model.num_layers)
    except ValueError as e:
        raise ConfigError(f"layers.indices: {e}") from e

    if cfg.optimizer._target_.startswith("bitsandbytes."):
        _check_importable(cfg.optimizer._target_, "optimizer", "Install it with `pip install bitsandbytes`, or choose optimizer=adamw.")
    else:
        _check_importable(cfg.optimizer._target_, "optimizer", "Install the package or choose another optimizer.")

    sync_cls = get_class(cfg.mode._target_)
    cuda = _cuda_available()
    check_layout(cfg, sync_cls, cuda, int(os.environ.get("WORLD_SIZE", "1")))
    if sync_cls.requires_cuda and not cuda:
        raise ConfigError(
            f"mode={_mode_name(cfg)} shares CUDA memory with vLLM and needs a CUDA GPU; none is visible here. "
            "Use mode=none, mode=lora_only or mode=lora_restart on this machine."
        )
    if cfg.train.device == "cuda" and not cuda:
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if cfg.train.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"train.device must be auto, cuda or cpu, got {cfg.train.device!r}")

    if sync_cls.uses_lora:
        if cfg.lora.r not in VLLM_LORA_RANKS:
            raise ConfigError(f"lora.r={cfg.lora.r} is not a rank vLLM serves; use one of {VLLM_LORA_RANKS}")
        if cfg.lora.r > cfg.server.max_lora_rank:
            raise ConfigError(f"lora.r={cfg.lora.r} exceeds server.max_lora_rank={cfg.server.max_lora_rank}; raise the latter")

    if cfg.model.offline is None:
        name = cfg.model.name
        looks_local = name.startswith(("/", ".", "~")) or os.path.isabs(name)
        if looks_local and not Path(name).expanduser().exists():
            raise ConfigError(f"model.name={name} does not exist")
        if not looks_local and os.environ.get("HF_HUB_OFFLINE") == "1" and not Path(name).exists():
            raise ConfigError(
                f"model.name={name} is a hub id but HF_HUB_OFFLINE=1; point model.name at a local directory "
                f"or set model.offline=<preset> for random weights"
            )

    if cfg.server.busy_loop_s is not None and cfg.server.busy_loop_s < 0:
        raise ConfigError(f"server.busy_loop_s must be >= 0 seconds or null, got {cfg.server.busy_loop_s}")

    if cfg.server.external_url is None and not _port_free(cfg.server.host, cfg.server.port):
        raise ConfigError(
            f"server.port={cfg.server.port} on {cfg.server.host} is already in use; pick a free port "
            "(server.port=...) or attach to that server with server.external_url=http://host:port"
        )

    if cfg.train.micro_batch_size < 1 or cfg.train.grad_accum < 1 or cfg.train.steps < 1:
        raise ConfigError("train.micro_batch_size, train.grad_accum and train.steps must all be >= 1")
    if cfg.train.advantage_norm not in ("group", "batch", "none"):
        raise ConfigError(f"train.advantage_norm must be group, batch or none, got {cfg.train.advantage_norm!r}")
    if cfg.train.lr_schedule not in ("constant", "linear", "cosine"):
        raise ConfigError(f"train.lr_schedule must be constant, linear or cosine, got {cfg.train.lr_schedule!r}")
    if cfg.train.resume is not None and not Path(cfg.train.resume).exists():
        raise ConfigError(f"train.resume={cfg.train.resume} does not exist")
    if cfg.logging.get("tensorboard", False):  # the package is optional; say so before any model loads
        from grpo.trainer.metrics import tensorboard_writer_class

        try:
            tensorboard_writer_class()
        except ImportError as e:
            raise ConfigError(str(e)) from e
    if run_dir is not None:
        check_run_dir(run_dir)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _mode_name(cfg: DictConfig) -> str:
    return cfg.mode._target_.rsplit(".", 1)[-1]

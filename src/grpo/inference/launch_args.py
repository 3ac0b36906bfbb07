"""What a vLLM server is launched with, beside its model: the parallel sizes and GPUs it spans, its compilation
config, the port it takes, the environment it must not inherit (torchrun's variables) and its tie to the launcher."""

from __future__ import annotations

import json
import signal
import socket
from typing import Any, Sequence

from grpo.config_values import ConfigError, option


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


def gpus_per_server(extra_args) -> int:
    """GPUs one vLLM server spans: tensor x pipeline x data parallel sizes of server.extra_args."""
    sizes = parallel_sizes(extra_args)
    return sizes["tensor"] * sizes["pipeline"] * sizes["data"]


def server_visible_devices(first: int, count: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of a server whose GPUs are `count` in a row from index `first`, numbered as the trainer
    numbers them: within the trainer's own CUDA_VISIBLE_DEVICES (`visible`) when it has one, as torch does."""
    indices = list(range(first, first + count))
    if not visible:
        return ",".join(map(str, indices))
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if indices[-1] >= len(ids):
        raise ConfigError(f"the server's GPUs {indices} (server.device / server.devices, and its parallel sizes) "
                          f"lie beyond the {len(ids)} GPU(s) of CUDA_VISIBLE_DEVICES={visible}")
    return ",".join(ids[i] for i in indices)


def pick_free_port(host: str) -> int:
    """A TCP port free on `host` a moment ago (the server's own exclusive bind closes the remaining race)."""
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host if host not in ("0.0.0.0", "") else "127.0.0.1", port)) == 0


def die_with_parent() -> None:
    """The launched server's `preexec_fn`: SIGTERM it when its launcher dies."""
    # Linux: SIGTERM the server if the trainer dies without stop() (SIGKILL, OOM), so no orphan keeps the port and
    # the memory; vLLM's own children follow their API server. Bound to the thread that started the server.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# What torchrun sets for each trainer rank (plus TORCHELASTIC_*).
TORCHRUN_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
})


def compilation_args(server_cfg: Any, extra_args: Sequence[str]) -> list[str]:
    """`--compilation-config` for server.compile=false and server.cuda_graph_sizes, or nothing when both are null."""
    compile_model, sizes = option(server_cfg, "compile"), option(server_cfg, "cuda_graph_sizes")
    if compile_model is None and sizes is None:
        return []
    if any(a == "-O" or a.startswith(("--compilation-config", "-cc", "-O")) for a in extra_args):
        raise ConfigError("server.compile / server.cuda_graph_sizes and a compilation flag in server.extra_args both set "
                         "vLLM's compilation config: keep one")
    config: dict[str, Any] = {}
    if compile_model is False:
        # No torch.compile: whole decode steps run as CUDA graphs (the piecewise graphs need the compiled model).
        config.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    if sizes is not None:
        config["cudagraph_capture_sizes"] = sorted({int(n) for n in sizes})
    return ["--compilation-config", json.dumps(config)]

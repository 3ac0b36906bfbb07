"""Shared fixtures: offline tiny models and free ports. Server fixtures are shared per session (vLLM start-up costs ~20 s)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

# Tests never reach a model hub; wandb stays offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    """Directory of the offline tiny Qwen2 model (built once, cached)."""
    from grpo.models.tiny import build_model_dir

    return build_model_dir("tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """Directory of the offline tiny Llama model (built once, cached)."""
    from grpo.models.tiny import build_model_dir

    return build_model_dir("tiny-llama", seed=0)


def server_cfg(port: int | None = None, **overrides):
    """A ServerConfig for the vLLM CPU engine and a tiny model (conf/server/cpu.yaml values)."""
    from grpo.config.schema import ServerConfig

    base = dict(
        host="127.0.0.1", port=port or free_port(), gpu_memory_utilization=0.2, max_model_len=512,
        dtype="float32", max_lora_rank=16, startup_timeout_s=240, busy_loop_s=0.02,
    )  # fmt: skip
    base.update(overrides)
    return ServerConfig(**base)


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen2_dir, tmp_path_factory):
    """ONE real vLLM CPU server (our grpo.inference.server) on tiny-qwen2 for the whole session, LoRA enabled.

    Tests that change its weights must put the original ones back (or use their own server).
    """
    from grpo.inference.process import VLLMServer

    log = tmp_path_factory.mktemp("vllm_session") / "vllm.log"
    server = VLLMServer(tiny_qwen2_dir, server_cfg(), log, enable_lora=True, served_model_name=str(tiny_qwen2_dir))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def process_group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` exists."""
    import os

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

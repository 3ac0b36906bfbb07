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

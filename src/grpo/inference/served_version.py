"""The weight version a server serves, kept in the state of vLLM's app: set by a trainer's sync (POST
/grpo/weight_version, an in-place reload), reported by every /generate answer; a LoRA adapter may be given versions of
its own (several trainers hot-swapping adapters into one server)."""

from __future__ import annotations

import os
from typing import Any

# Initial weight version (the process manager sets it on a restart so versions keep increasing).
VERSION_ENV = "GRPO_WEIGHT_VERSION"


def app_state(request) -> Any:
    """The app state of vLLM's FastAPI app, where the served versions are kept."""
    # Starlette sets scope["app"] to vLLM's FastAPI app before the middleware stack runs.
    return request.app.state


def served_version(state) -> int:
    if not hasattr(state, "grpo_weight_version"):
        state.grpo_weight_version = int(os.environ.get(VERSION_ENV, "0"))
    return state.grpo_weight_version


def upper_version(state) -> int:
    """The newest version whose weights may already be in use: a reload in progress counts as its new version."""
    return max(served_version(state), getattr(state, "grpo_weight_version_pending", 0))


def adapter_versions(state) -> dict[str, int]:
    """The weight version each LoRA adapter was given (POST /grpo/weight_version with a "model"): several trainers
    hot-swapping adapters of their own into one server each count their own versions."""
    if not hasattr(state, "grpo_adapter_versions"):
        state.grpo_adapter_versions = {}
    return state.grpo_adapter_versions


def request_versions(state, lora: Any) -> tuple[int, int]:
    """(admission version, upper version) of a request: an adapter given a version of its own is that version
    throughout (an adapter never changes once loaded); otherwise the server's."""
    own = adapter_versions(state).get(lora.lora_name) if lora is not None else None
    if own is not None:
        return own, own
    return served_version(state), upper_version(state)

"""Checks of a /generate request before it reaches the engine, so a bad request gets a 4xx with the reason.

Without them vLLM raises on an out-of-vocabulary id, an empty or over-long prompt or `max_tokens < 1` from deep
inside the engine, and the answer was HTTP 500, which clients (atroposlib included) retry as a server fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class BadRequest(ValueError):
    """The request cannot be served as sent; `status` is the HTTP status to answer with (4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts: token ids in [0, vocab_size), prompts shorter than max_model_len."""

    vocab_size: int
    max_model_len: int


async def model_limits(engine: Any) -> ModelLimits:
    """The served model's limits, read from the engine's model config (an attribute in vLLM >= 0.10, a coroutine
    before)."""
    config = getattr(engine, "model_config", None)
    if config is None:
        config = await engine.get_model_config()
    return ModelLimits(vocab_size=int(config.get_vocab_size()), max_model_len=int(config.max_model_len))


def check_generate_request(prompt_ids: list[int], max_tokens: Any, limits: ModelLimits) -> None:
    """Raise BadRequest naming what is wrong: an empty prompt, an id outside the vocabulary, a prompt that leaves no
    room to generate within max_model_len, or max_tokens below 1 (None = the engine's default, accepted)."""
    if not prompt_ids:
        raise BadRequest("empty prompt: send at least one token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequest(
            f"token id(s) {bad[:5]} out of vocabulary: ids must be integers in [0, {limits.vocab_size})"
        )
    if len(prompt_ids) >= limits.max_model_len:
        raise BadRequest(
            f"prompt of {len(prompt_ids)} tokens leaves no room to generate: the server's max_model_len is "
            f"{limits.max_model_len} (prompt + completion); shorten the prompt or raise server.max_model_len"
        )
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")

"""Checks of a /generate request before it reaches the engine, so a bad request gets a 4xx with the reason.

Without them vLLM raises on an out-of-vocabulary id, an empty or over-long prompt or `max_tokens < 1` from deep
inside the engine, and the answer was HTTP 500, which clients (atroposlib included) retry as a server fault.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


class BadRequest(ValueError):
    """The request cannot be served as sent; `status` is the HTTP status to answer with (4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# Sequences (prompts x n) one /generate request may ask for unless the server says otherwise
# (`--max-sequences-per-request`, server.max_sequences_per_request): 64 prompts x n=64. Without a bound one request
# of 2,000 prompts x n=128 held the engine for ten minutes while every other request waited.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 4096
# The environment variable through which grpo-serve hands its --max-sequences-per-request to the middleware.
MAX_SEQUENCES_ENV = "GRPO_MAX_SEQUENCES_PER_REQUEST"
# A string prompt longer than this many characters per token of max_model_len cannot fit the context: it is refused
# before it is tokenized (a 40 MB string took 51 s of the server's event loop to tokenize, then was refused).
MAX_PROMPT_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts: token ids in [0, vocab_size), prompt + completion within max_model_len, at
    most max_num_seqs samples per prompt (the sequences the engine runs at once; None: not bounded) and at most
    max_sequences_per_request sequences (prompts x n) per request (None: not bounded)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int | None = None
    max_sequences_per_request: int | None = None
    # vLLM's scheduling policy (--scheduling-policy): "priority" orders waiting requests by their `priority`.
    scheduling_policy: str = "fcfs"

    @property
    def max_prompt_chars(self) -> int:
        """The longest string prompt tokenized: MAX_PROMPT_CHARS_PER_TOKEN characters per token of max_model_len."""
        return MAX_PROMPT_CHARS_PER_TOKEN * self.max_model_len


def max_sequences_per_request() -> int | None:
    """This server's bound on sequences per request (MAX_SEQUENCES_ENV, else the default; 0 = none)."""
    value = int(os.environ.get(MAX_SEQUENCES_ENV) or DEFAULT_MAX_SEQUENCES_PER_REQUEST)
    return value if value > 0 else None


async def model_limits(engine: Any) -> ModelLimits:
    """The served model's limits, read from the engine's model and scheduler configs (attributes in vLLM >= 0.10,
    a coroutine for the model config before)."""
    config = getattr(engine, "model_config", None)
    if config is None:
        config = await engine.get_model_config()
    # vLLM 0.26's AsyncLLM keeps it only inside its vllm_config (0.32 has both): without it a priority server was
    # taken for fcfs and refused the evaluation's requests on the GPU.
    scheduler = getattr(engine, "scheduler_config", None) or getattr(getattr(engine, "vllm_config", None),
                                                                     "scheduler_config", None)
    seqs = getattr(scheduler, "max_num_seqs", None)
    return ModelLimits(vocab_size=int(config.get_vocab_size()), max_model_len=int(config.max_model_len),
                       max_num_seqs=int(seqs) if seqs else None, max_sequences_per_request=max_sequences_per_request(),
                       scheduling_policy=str(getattr(scheduler, "policy", "fcfs")))


def request_priority(body: dict[str, Any], limits: ModelLimits) -> int:
    """The `priority` of a /generate body, taken out of it (vLLM's rule: the engine schedules waiting requests with a
    lower value first; 0 when absent). A non-zero one needs a server that schedules by priority: vLLM's default
    first-come-first-served policy would ignore it without a word."""
    priority = body.pop("priority", 0)
    if not _is_int(priority):
        raise BadRequest(f"priority must be an integer (lower is scheduled sooner), got {priority!r:.80}")
    if priority != 0 and limits.scheduling_policy != "priority":
        raise BadRequest(f"priority={priority} needs a server started with --scheduling-policy priority "
                         f"(server.scheduling_policy=priority); this one schedules {limits.scheduling_policy!r}. "
                         "Or send no priority (eval.priority=0).")
    return priority


def _is_int(value: Any) -> bool:
    """A JSON integer (not a bool, which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(value: Any, where: str = "prompt_token_ids") -> list[int]:
    """A prompt's token ids as sent: a list of JSON integers, taken as they are. Coercing them served `[1.7, 2.2]`
    as `[1, 2]`, `["7", "8"]` as `[7, 8]` and `[true, false]` as `[1, 0]`; a null was a Python TypeError's text."""
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list of integer token ids, got {type(value).__name__} {value!r:.80}")
    bad = [t for t in value if not _is_int(t)]
    if bad:
        raise BadRequest(f"{where} must hold integer token ids only; got {bad[:5]!r:.120}")
    return value


def check_generate_request(prompt_ids: list[int], max_tokens: Any, limits: ModelLimits, n: Any = 1) -> None:
    """Raise BadRequest naming what is wrong: an empty prompt, an id outside the vocabulary, a prompt that leaves no
    room to generate within max_model_len, max_tokens below 1 or past the context the prompt leaves (None = the
    engine's default, accepted), or n outside [1, max_num_seqs]."""
    if not prompt_ids:
        raise BadRequest("empty prompt: send at least one token")
    bad = [t for t in prompt_ids if not _is_int(t) or not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequest(
            f"token id(s) {bad[:5]} out of vocabulary: ids must be integers in [0, {limits.vocab_size})"
        )
    room = limits.max_model_len - len(prompt_ids)
    if room < 1:
        raise BadRequest(
            f"prompt of {len(prompt_ids)} tokens leaves no room to generate: the server's max_model_len is "
            f"{limits.max_model_len} (prompt + completion); shorten the prompt or raise server.max_model_len"
        )
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")
        # vLLM stops at max_model_len without a word: max_tokens=10**9 was accepted and cut at the context.
        if max_tokens > room:
            raise BadRequest(f"max_tokens={max_tokens} is more than this prompt leaves: at most {room} (the server's "
                             f"max_model_len {limits.max_model_len} minus the prompt's {len(prompt_ids)} tokens)")
    check_samples(n, limits)


def check_samples(n: Any, limits: ModelLimits) -> None:
    """`n` samples of a prompt: an integer in [1, max_num_seqs]. One request of n=10000 held the engine for 46 s
    while every other request waited behind it."""
    if n is None:
        return
    if not _is_int(n) or n < 1:
        raise BadRequest(f"n must be an integer >= 1, got {n!r}")
    if limits.max_num_seqs is not None and n > limits.max_num_seqs:
        raise BadRequest(f"n={n} is more samples than the server runs at once: at most {limits.max_num_seqs} "
                         "(vLLM's --max-num-seqs); send several requests")


def check_sequences(prompts: int, n: Any, limits: ModelLimits) -> None:
    """`prompts` prompts x `n` samples within the server's bound on sequences per request (n already checked)."""
    total = prompts * (n if _is_int(n) else 1)
    bound = limits.max_sequences_per_request
    if bound is not None and total > bound:
        raise BadRequest(f"{prompts} prompt(s) x n={n} = {total} sequences: this server serves at most {bound} "
                         "sequences per request (grpo-serve --max-sequences-per-request, "
                         "server.max_sequences_per_request); send several requests")


def check_prompt_chars(prompt: str, limits: ModelLimits) -> None:
    """A string prompt short enough to be worth tokenizing (ModelLimits.max_prompt_chars)."""
    if len(prompt) > limits.max_prompt_chars:
        raise BadRequest(f"string prompt of {len(prompt)} characters: at most {limits.max_prompt_chars} are tokenized "
                         f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of the server's max_model_len "
                         f"{limits.max_model_len}); shorten it, or send token ids")

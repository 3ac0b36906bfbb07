"""The wire format: one GRPO group (completions of one prompt), as Atropos' run-api hands it out and as the local
rollout pipeline produces it. `parse_group` is the one validator of a group from outside; `Group` is what both
pipelines hand to the batcher (grpo.pipeline.batching).

Wire shape (atroposlib 0.4.0; docs/architecture.md):

    {"tokens": [[int]], "masks": [[int]],          # masks: IGNORE_INDEX at prompt positions, else the token id
     "scores": [float],
     "advantages": [[float]] | [float] | null,     # per token or per sequence; used instead of scores when present
     "ref_logprobs": [[float]] | null, "inference_logprobs": [[float]] | null,   # one per token
     "generation_params": {"temperature": float} | null,
     "overrides": [{"temperature": .., "set_advantage_to_zero": bool}] | null,   # per sequence
     "group_overrides": {"temperature": ..} | null, "weight_version": int | null, ...}

Weight versions: `weight_version` (the version served when the group's requests were sent) and
`last_weight_version` (when its last completion came back), at the top level or inside `generation_params`. run-api
(atroposlib 0.4.0) keeps only the fields of its `ScoredData` model, so an Atropos environment sends them in
`generation_params` (grpo.tasks.atropos_env does); `to_wire` puts them at the top level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional, Union

from grpo.trainer.train_batch import IGNORE_INDEX

# A sequence's advantage from the server: one number, or one per token (unshifted); None = from the scores.
Advantage = Union[float, list[float], None]


class MalformedGroup(ValueError):
    """A group that fails validation; `field` names the offending field."""

    def __init__(self, field_name: str, msg: str) -> None:
        super().__init__(f"{field_name}: {msg}")
        self.field = field_name


@dataclass
class Group:
    """One validated group, one entry per sequence in every list. Temperatures are resolved per sequence
    (overrides[i] > generation_params > group_overrides > 1.0)."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[Advantage]
    inference_logprobs: list[Optional[list[float]]]
    ref_logprobs: list[Optional[list[float]]]
    temperatures: list[float]
    zero_advantage: list[bool]
    # Weight version the sequences were sampled under (None when the source does not say): for local rollouts the
    # version served when the requests were sent, so at most the version of any of their tokens.
    weight_version: Optional[int] = None
    # The version served when the last completion came back (at least the version of any token); differs from
    # weight_version when a sync landed during generation (train.max_staleness >= 1, Atropos). None = unknown.
    last_weight_version: Optional[int] = None
    # The Atropos environment the group came from (run-api's id; None for local rollouts).
    env_id: Optional[int] = None
    # Multi-turn rollouts (grpo.pipeline.multi_turn): per sequence, each model turn's (weight_version,
    # last_weight_version); a sync between turns makes them differ. None = single-turn or not reported.
    turn_versions: Optional[list[list[tuple[int, int]]]] = None
    # Per sequence: True when generation stopped at the token limit, not at EOS or a stop (vLLM's finish_reason
    # 'length'; for multi-turn, an episode cut short). None = the source does not say (Atropos).
    truncated: Optional[list[bool]] = None
    # The completion-token limit the sequences were sampled under (the requests' max_tokens); None = not reported.
    max_new_tokens: Optional[int] = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def sampled(
        cls, prompt: list[int], completions: list[list[int]], logprobs: list[Optional[list[float]]], scores: list[float],
        temperature: float, weight_version: Optional[int] = None, truncated: Optional[list[bool]] = None,
        max_new_tokens: Optional[int] = None,
    ) -> "Group":
        """A group of completions of `prompt` sampled at `temperature`, with their rollout log-probs (None for a
        completion sampled without them: the loss trains it as on-policy), which of them hit the token limit
        `max_new_tokens` (`truncated`), where the source knows."""
        n = len(completions)
        return cls(
            tokens=[prompt + list(c) for c in completions],
            masks=[[IGNORE_INDEX] * len(prompt) + list(c) for c in completions],
            scores=[float(s) for s in scores],
            advantages=[None] * n,
            # The prompt positions carry no log-prob; 1.0 there as Atropos sends (never read: no loss there).
            inference_logprobs=[None if lp is None else [1.0] * len(prompt) + [float(x) for x in lp] for lp in logprobs],
            ref_logprobs=[None] * n,
            temperatures=[float(temperature)] * n,
            zero_advantage=[False] * n,
            weight_version=weight_version,
            truncated=None if truncated is None else [bool(t) for t in truncated],
            max_new_tokens=max_new_tokens,
        )

    def to_wire(self) -> dict[str, Any]:
        """The Atropos dict of this group (per-sequence temperatures as overrides)."""
        return {
            "tokens": self.tokens, "masks": self.masks, "scores": self.scores,
            "advantages": None if all(a is None for a in self.advantages) else self.advantages,
            "inference_logprobs": self.inference_logprobs, "ref_logprobs": None,
            "overrides": [{"temperature": t, "set_advantage_to_zero": z}
                          for t, z in zip(self.temperatures, self.zero_advantage)],
            "generation_params": None, "group_overrides": None, "weight_version": self.weight_version,
            "last_weight_version": self.last_weight_version, "env_id": self.env_id,
        }


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# The trainer holds a group's numbers as float32 (grpo.pipeline.batching._collate), so the wire format stops at its
# range: past it a score of 1e200 made its group's spread overflow to a zero advantage, an advantage of 1e39 stopped
# the run in the batcher (no float32 holds it), a log-prob of -1e39 became -inf. torch.finfo(torch.float32).max:
FLOAT32_MAX = 3.4028234663852886e38


def _is_num(x: Any) -> bool:
    """A finite number within float32's range (not a bool)."""
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x) and abs(x) <= FLOAT32_MAX


def _per_sequence_list(raw: dict, key: str, n: int) -> list:
    value = raw.get(key)
    if value is None:
        raise MalformedGroup(key, "is null or missing")
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise MalformedGroup(key, f"has {got} entries but the group has {n} sequences")
    return list(value)


def _tokens(raw: dict, vocab_size: Optional[int]) -> list[list[int]]:
    tokens = raw.get("tokens")
    if tokens is None:
        raise MalformedGroup("tokens", "is null or missing")
    if not isinstance(tokens, (list, tuple)):
        raise MalformedGroup("tokens", f"expected a list of token lists, got {type(tokens).__name__}")
    for i, row in enumerate(tokens):
        if not isinstance(row, (list, tuple)) or not row or not all(_is_int(t) for t in row):
            raise MalformedGroup("tokens", f"sequence {i} is empty or not a list of ints")
        bad = [t for t in row if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise MalformedGroup("tokens", f"sequence {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return [list(row) for row in tokens]


def _masks(raw: dict, tokens: list[list[int]]) -> list[list[int]]:
    masks = _per_sequence_list(raw, "masks", len(tokens))
    for i, (row, seq) in enumerate(zip(masks, tokens)):
        if not isinstance(row, (list, tuple)) or len(row) != len(seq):
            got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
            raise MalformedGroup("masks", f"sequence {i} has length {got}, tokens has {len(seq)}")
        if not all(_is_int(m) for m in row):
            raise MalformedGroup("masks", f"sequence {i} has a null or non-integer value")
        # Completion positions carry the token id itself; anything else would train on the wrong target.
        if any(m != IGNORE_INDEX and m != t for m, t in zip(row, seq)):
            raise MalformedGroup("masks", f"sequence {i}: a value is neither {IGNORE_INDEX} nor the token id there")
    return [list(row) for row in masks]


def _per_token_rows(raw: dict, key: str, lengths: list[int]) -> list[Optional[list[float]]]:
    """Optional field: null, or one row of finite numbers per sequence (a row may be null)."""
    value = raw.get(key)
    if value is None:
        return [None] * len(lengths)
    if not isinstance(value, (list, tuple)) or len(value) != len(lengths):
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise MalformedGroup(key, f"has {got} entries but the group has {len(lengths)} sequences")
    rows: list[Optional[list[float]]] = []
    for i, (row, n) in enumerate(zip(value, lengths)):
        if row is None:
            rows.append(None)
            continue
        if not isinstance(row, (list, tuple)) or len(row) != n:
            got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
            raise MalformedGroup(key, f"sequence {i} has length {got}, tokens has {n}")
        if not all(_is_num(v) for v in row):
            bad = next(v for v in row if not _is_num(v))
            raise MalformedGroup(key, f"sequence {i} has {bad!r}: not a finite number within float32's range")
        rows.append([float(v) for v in row])
    return rows


def _advantages(raw: dict, lengths: list[int]) -> list[Advantage]:
    if raw.get("advantages") is None:
        return [None] * len(lengths)
    out: list[Advantage] = []
    for i, (a, n) in enumerate(zip(_per_sequence_list(raw, "advantages", len(lengths)), lengths)):
        if _is_num(a):
            out.append(float(a))
        elif isinstance(a, (list, tuple)) and len(a) == n and all(_is_num(v) for v in a):
            out.append([float(v) for v in a])
        else:
            raise MalformedGroup("advantages", f"sequence {i} must be a finite number or {n} finite numbers, within "
                                 "float32's range")
    return out


def _temperature(where: str, params: Any) -> Optional[float]:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise MalformedGroup(where, f"expected an object or null, got {type(params).__name__}")
    t = params.get("temperature")
    if t is not None and not (_is_num(t) and t > 0):
        raise MalformedGroup(where, f"temperature must be a positive number, got {t!r}")
    return None if t is None else float(t)


def _temperatures_and_zeros(raw: dict, n: int) -> tuple[list[float], list[bool]]:
    t_gen = _temperature("generation_params", raw.get("generation_params"))
    t_group = _temperature("group_overrides", raw.get("group_overrides"))
    overrides = raw.get("overrides")
    if overrides is not None and (not isinstance(overrides, (list, tuple)) or len(overrides) != n):
        raise MalformedGroup("overrides", f"expected null or a list of {n} per-sequence objects")
    temps, zeros = [], []
    for i in range(n):
        ov = overrides[i] if overrides is not None else None
        if ov is not None and not isinstance(ov, dict):
            raise MalformedGroup("overrides", f"sequence {i} is not an object")
        t_seq = _temperature("overrides", ov)
        # Precedence: the sequence's own sampling temperature, then the group's generation params, then the
        # group-wide override, then 1.0.
        temps.append(next((t for t in (t_seq, t_gen, t_group) if t is not None), 1.0))
        zero = (ov or {}).get("set_advantage_to_zero")
        if zero is not None and not isinstance(zero, bool) and zero not in (0, 1):
            # bool("false") is True: a string or any other number here would silently zero the sequence's advantage.
            raise MalformedGroup("overrides", f"sequence {i}: set_advantage_to_zero must be true, false (or 1, 0) or "
                                 f"null, got {zero!r}")
        zeros.append(bool(zero))
    return temps, zeros


def parse_group(raw: Any, vocab_size: Optional[int] = None) -> Group:
    """Validate a wire-format group; raises MalformedGroup naming the field. An empty `tokens` list gives an empty
    Group (the caller decides: the batcher drops and counts it)."""
    if not isinstance(raw, dict):
        raise MalformedGroup("<group>", f"expected an object, got {type(raw).__name__}")
    tokens = _tokens(raw, vocab_size)
    lengths = [len(t) for t in tokens]
    masks = _masks(raw, tokens)
    scores = _per_sequence_list(raw, "scores", len(tokens))
    bad = [s for s in scores if not _is_num(s)]
    if bad:
        raise MalformedGroup("scores", f"has {bad[0]!r}: not a finite number within float32's range")
    temps, zeros = _temperatures_and_zeros(raw, len(tokens))
    version, last_version = _versions(raw)
    return Group(
        tokens=tokens, masks=masks, scores=[float(s) for s in scores], advantages=_advantages(raw, lengths),
        inference_logprobs=_per_token_rows(raw, "inference_logprobs", lengths),
        ref_logprobs=_per_token_rows(raw, "ref_logprobs", lengths),
        temperatures=temps, zero_advantage=zeros, weight_version=version,
        last_weight_version=last_version, env_id=raw.get("env_id") if _is_int(raw.get("env_id")) else None,
    )


def _versions(raw: dict) -> tuple[Optional[int], Optional[int]]:
    """(weight_version, last_weight_version) from the top level, else from `generation_params` (where they survive
    run-api); None where absent. A value that is not an integer >= 0 is malformed (lag would be meaningless)."""
    params = raw.get("generation_params") if isinstance(raw.get("generation_params"), dict) else {}
    out: list[Optional[int]] = []
    for key in ("weight_version", "last_weight_version"):
        value = raw.get(key)
        where = key
        if value is None:
            value, where = params.get(key), f"generation_params.{key}"
        if value is not None and not (_is_int(value) and value >= 0):
            raise MalformedGroup(where, f"expected an integer >= 0 or null, got {value!r}")
        out.append(value)
    first, last = out
    if first is not None and last is not None and last < first:
        raise MalformedGroup("last_weight_version", f"{last} is older than weight_version {first}")
    return first, last

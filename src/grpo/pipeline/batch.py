"""Atropos groups → padded, causally shifted training micro-batches.

One optimizer step's groups (the Atropos wire format, see docs/architecture.md) are validated, turned into
advantages, shifted for a causal LM, padded and split into micro-batches. Every decision about the data (what is
dropped, what is missing) is counted in ``PreparedBatch.metrics`` so nothing is silently discarded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

IGNORE = -100
ADVANTAGE_NORMS = ("group", "batch", "none")
_STD_EPS = 1e-6


class BatchError(ValueError):
    """A group from the data source is malformed; the message names the group index and the field."""

    def __init__(self, group: int, field_name: str, msg: str):
        super().__init__(f"group {group}: field {field_name!r}: {msg}")
        self.group = group
        self.field = field_name


@dataclass
class TrainBatch:
    """One micro-batch, already shifted for a causal LM: ``labels[:, t]`` is the token after ``input_ids[:, t]``.

    All tensors are ``[B, T]`` except ``advantages`` (``[B]`` or ``[B, T]``), ``temperatures`` and ``scores``
    (``[B]``). ``inference_logprobs`` is NaN where the server sent none (the loss treats those as on-policy);
    ``ref_logprobs`` is None when no sequence of the micro-batch carries reference log-probs, else NaN where missing.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    advantages: torch.Tensor
    temperatures: torch.Tensor
    scores: torch.Tensor

    @property
    def num_sequences(self) -> int:
        """Sequences (rows) in this micro-batch."""
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Completion tokens that carry loss in this micro-batch."""
        return int(self.loss_mask.sum().item())

    def to(self, device: Any) -> "TrainBatch":
        """A copy with every tensor on ``device``."""
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TrainBatch(**kw)


@dataclass
class PreparedBatch:
    """The micro-batches of one optimizer step and what happened to the data on the way."""

    micro_batches: list[TrainBatch]
    metrics: dict[str, float] = field(default_factory=dict)
    # Global normalisers for gradient accumulation (passed to the loss as total_tokens / total_sequences).
    num_loss_tokens: int = 0
    num_sequences: int = 0
    # Longest completion (loss tokens of one sequence) in the whole step: the default Dr. GRPO divisor.
    max_completion_tokens: int = 0


@dataclass
class _Seq:
    tokens: list[int]
    masks: list[int]
    score: float
    advantage: Any  # float, or list[float] per token (unshifted)
    inference_logprobs: Optional[list[float]]
    ref_logprobs: Optional[list[float]]
    temperature: float
    zero_adv: bool = False


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_rows(gi: int, name: str, rows: Any, n: int, lengths: Sequence[int], allow_null_rows: bool) -> list:
    """A per-sequence list of per-token float lists, aligned with ``tokens``."""
    if not isinstance(rows, (list, tuple)):
        raise BatchError(gi, name, f"expected a list of {n} per-token lists, got {type(rows).__name__}")
    if len(rows) != n:
        raise BatchError(gi, name, f"has {len(rows)} entries but the group has {n} sequences")
    out = []
    for i, row in enumerate(rows):
        if row is None:
            if not allow_null_rows:
                raise BatchError(gi, name, f"sequence {i} is null")
            out.append(None)
            continue
        if not isinstance(row, (list, tuple)) or len(row) != lengths[i]:
            got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
            raise BatchError(gi, name, f"sequence {i} has length {got}, tokens has {lengths[i]}")
        if not all(_is_num(v) for v in row):
            raise BatchError(gi, name, f"sequence {i} has a null or non-numeric value")
        out.append([float(v) for v in row])
    return out


def _temperature(gi: int, where: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if not _is_num(value) or not math.isfinite(value) or value <= 0:
        raise BatchError(gi, where, f"temperature must be a positive number, got {value!r}")
    return float(value)


def _parse_group(gi: int, g: Any, vocab_size: Optional[int]) -> Optional[list[_Seq]]:
    """Validate one group; None when it is empty (dropped and counted by the caller)."""
    if not isinstance(g, dict):
        raise BatchError(gi, "<group>", f"expected a dict, got {type(g).__name__}")
    tokens = g.get("tokens")
    if tokens is None:
        raise BatchError(gi, "tokens", "is null or missing")
    if not isinstance(tokens, (list, tuple)):
        raise BatchError(gi, "tokens", f"expected a list of token lists, got {type(tokens).__name__}")
    n = len(tokens)
    if n == 0:
        return None
    lengths = []
    for i, row in enumerate(tokens):
        if not isinstance(row, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise BatchError(gi, "tokens", f"sequence {i} is not a list of ints")
        bad = [t for t in row if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise BatchError(gi, "tokens", f"sequence {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        lengths.append(len(row))

    masks = g.get("masks")
    if masks is None:
        raise BatchError(gi, "masks", "is null or missing")
    if not isinstance(masks, (list, tuple)) or len(masks) != n:
        raise BatchError(gi, "masks", f"expected {n} mask lists")
    for i, row in enumerate(masks):
        if not isinstance(row, (list, tuple)) or len(row) != lengths[i]:
            got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
            raise BatchError(gi, "masks", f"sequence {i} has length {got}, tokens has {lengths[i]}")
        if not all(isinstance(m, int) and not isinstance(m, bool) for m in row):
            raise BatchError(gi, "masks", f"sequence {i} has a null or non-integer value")

    scores = g.get("scores")
    if scores is None:
        raise BatchError(gi, "scores", "is null or missing")
    if not isinstance(scores, (list, tuple)) or len(scores) != n:
        got = len(scores) if isinstance(scores, (list, tuple)) else type(scores).__name__
        raise BatchError(gi, "scores", f"has {got} entries but the group has {n} sequences")
    if not all(_is_num(s) and math.isfinite(s) for s in scores):
        raise BatchError(gi, "scores", "has a null or non-finite value")

    advantages: list[Any] = [None] * n
    adv = g.get("advantages")
    if adv is not None:
        if not isinstance(adv, (list, tuple)) or len(adv) != n:
            got = len(adv) if isinstance(adv, (list, tuple)) else type(adv).__name__
            raise BatchError(gi, "advantages", f"has {got} entries but the group has {n} sequences")
        for i, a in enumerate(adv):
            if _is_num(a):
                if not math.isfinite(a):
                    raise BatchError(gi, "advantages", f"sequence {i} is not finite")
                advantages[i] = float(a)
            elif isinstance(a, (list, tuple)) and len(a) == lengths[i] and all(_is_num(v) for v in a):
                advantages[i] = [float(v) for v in a]
                if not all(math.isfinite(v) for v in advantages[i]):
                    raise BatchError(gi, "advantages", f"sequence {i} has a non-finite value")
            else:
                raise BatchError(
                    gi, "advantages", f"sequence {i} must be a number or {lengths[i]} per-token numbers, got {a!r:.60}"
                )

    inf_lp = g.get("inference_logprobs")
    inf_rows = [None] * n if inf_lp is None else _check_rows(gi, "inference_logprobs", inf_lp, n, lengths, True)
    ref_lp = g.get("ref_logprobs")
    ref_rows = [None] * n if ref_lp is None else _check_rows(gi, "ref_logprobs", ref_lp, n, lengths, True)

    gen = g.get("generation_params")
    if gen is not None and not isinstance(gen, dict):
        raise BatchError(gi, "generation_params", "expected a dict or null")
    gover = g.get("group_overrides")
    if gover is not None and not isinstance(gover, dict):
        raise BatchError(gi, "group_overrides", "expected a dict or null")
    overrides = g.get("overrides")
    if overrides is not None and (not isinstance(overrides, (list, tuple)) or len(overrides) != n):
        raise BatchError(gi, "overrides", f"expected null or a list of {n} per-sequence dicts")
    t_gen = _temperature(gi, "generation_params", (gen or {}).get("temperature"))
    t_group = _temperature(gi, "group_overrides", (gover or {}).get("temperature"))

    seqs = []
    for i in range(n):
        ov = overrides[i] if overrides is not None else None
        if ov is not None and not isinstance(ov, dict):
            raise BatchError(gi, "overrides", f"sequence {i} is not a dict")
        ov = ov or {}
        t_seq = _temperature(gi, "overrides", ov.get("temperature"))
        # Precedence: the sequence's own sampling temperature, then the group's generation params, then the
        # group-wide override, then 1.0.
        temp = next((t for t in (t_seq, t_gen, t_group) if t is not None), 1.0)
        zero = bool(ov.get("set_advantage_to_zero", False))
        seqs.append(
            _Seq(list(tokens[i]), list(masks[i]), float(scores[i]), advantages[i], inf_rows[i], ref_rows[i], temp, zero)
        )
    return seqs


def _group_advantages(seqs: list[_Seq], norm: str, batch_std: float) -> None:
    """Fill ``advantage`` of the sequences that the server sent none for, from the group's scores."""
    need = [s for s in seqs if s.advantage is None]
    if not need:
        return
    scores = torch.tensor([s.score for s in seqs], dtype=torch.float64)
    centred = scores - scores.mean()
    if norm == "group":
        # Population std of the group: a group whose rewards all agree gets zero advantage, not a blow-up.
        adv = centred / (scores.std(unbiased=False) + _STD_EPS)
    elif norm == "batch":
        adv = centred / (batch_std + _STD_EPS)
    else:
        adv = centred
    for s, a in zip(seqs, adv.tolist()):
        if s.advantage is None:
            s.advantage = a


def _shifted(row: Optional[list[float]], length: int) -> list[float]:
    """Per-token values aligned with labels: value[t + 1] belongs to labels[t]."""
    if row is None:
        return [math.nan] * (length - 1)
    return row[1:length]


def _collate(seqs: list[_Seq], pad_token_id: int, per_token_adv: bool) -> TrainBatch:
    B = len(seqs)
    T = max(max(len(s.tokens) - 1 for s in seqs), 1)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    inf = torch.zeros((B, T), dtype=torch.float32)
    has_ref = any(s.ref_logprobs is not None for s in seqs)
    ref = torch.zeros((B, T), dtype=torch.float32) if has_ref else None
    adv = torch.zeros((B, T) if per_token_adv else (B,), dtype=torch.float32)
    for b, s in enumerate(seqs):
        L = len(s.tokens) - 1
        if L <= 0:
            continue
        toks = torch.tensor(s.tokens, dtype=torch.long)
        trained = torch.tensor(s.masks[1:], dtype=torch.long) != IGNORE
        input_ids[b, :L] = toks[:-1]
        attention_mask[b, :L] = 1
        labels[b, :L] = torch.where(trained, toks[1:], torch.full_like(toks[1:], IGNORE))
        if s.inference_logprobs is None:
            inf[b] = math.nan  # the whole row: the loss treats it as on-policy
        else:
            inf[b, :L] = torch.tensor(_shifted(s.inference_logprobs, L + 1))
        if ref is not None:
            if s.ref_logprobs is None:
                ref[b] = math.nan
            else:
                ref[b, :L] = torch.tensor(_shifted(s.ref_logprobs, L + 1))
        if per_token_adv:
            if isinstance(s.advantage, list):
                adv[b, :L] = torch.tensor(_shifted(s.advantage, L + 1))
            else:
                adv[b, :L] = s.advantage
        else:
            adv[b] = s.advantage
    loss_mask = (labels != IGNORE).float()
    if per_token_adv:
        adv = adv * loss_mask
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        loss_mask=loss_mask,
        inference_logprobs=inf,
        ref_logprobs=ref,
        advantages=adv,
        temperatures=torch.tensor([s.temperature for s in seqs], dtype=torch.float32),
        scores=torch.tensor([s.score for s in seqs], dtype=torch.float32),
    )


def prepare_batch(
    groups: list[dict],
    *,
    advantage_norm: str = "group",
    max_seq_len: int,
    micro_batch_size: int,
    pad_token_id: int,
    vocab_size: Optional[int] = None,
) -> PreparedBatch:
    """Validate Atropos groups and turn them into causally shifted, padded micro-batches.

    - Required fields (``tokens``, ``masks``, ``scores``) that are null, and any field whose length does not
      match the group, raise ``BatchError`` naming the group and the field; token ids outside ``[0, vocab_size)``
      too. An empty group is dropped (``data/dropped_groups``).
    - Advantages: the server's ``advantages`` (per sequence or per token) when sent; else from ``scores`` within
      the group: ``group`` = (r - mean) / (std + 1e-6), ``batch`` = (r - group mean) / (std of all rewards of the
      batch + 1e-6), ``none`` = r - group mean (population std throughout). Computed on the whole group before
      too-long sequences are dropped, so the baseline sees every sample. ``overrides[i].set_advantage_to_zero``
      zeroes sequence i's advantage.
    - Sequences longer than ``max_seq_len`` are dropped (``data/dropped_too_long``).
    - Temperature per sequence: overrides[i].temperature > generation_params.temperature >
      group_overrides.temperature > 1.0.
    - Null ``inference_logprobs`` (group or sequence) become NaN rows (``data/missing_logprobs`` counts them).
    """
    if advantage_norm not in ADVANTAGE_NORMS:
        raise ValueError(f"advantage_norm must be one of {ADVANTAGE_NORMS}, got {advantage_norm!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")

    parsed: list[list[_Seq]] = []
    dropped_groups = 0
    for gi, g in enumerate(groups):
        seqs = _parse_group(gi, g, vocab_size)
        if seqs is None:
            dropped_groups += 1
        else:
            parsed.append(seqs)

    all_scores = [s.score for seqs in parsed for s in seqs]
    batch_std = float(torch.tensor(all_scores, dtype=torch.float64).std(unbiased=False)) if all_scores else 0.0
    kept: list[_Seq] = []
    too_long = 0
    for seqs in parsed:
        _group_advantages(seqs, advantage_norm, batch_std)
        group_kept = 0
        for s in seqs:
            if s.zero_adv:
                s.advantage = [0.0] * len(s.tokens) if isinstance(s.advantage, list) else 0.0
            if len(s.tokens) > max_seq_len:
                too_long += 1
                continue
            kept.append(s)
            group_kept += 1
        if group_kept == 0:
            dropped_groups += 1

    per_token_adv = any(isinstance(s.advantage, list) for s in kept)
    micro = [
        _collate(kept[i : i + micro_batch_size], pad_token_id, per_token_adv)
        for i in range(0, len(kept), micro_batch_size)
    ]
    completion = [sum(1 for m in s.masks[1:] if m != IGNORE) for s in kept]
    scores = torch.tensor(all_scores, dtype=torch.float64)
    metrics = {
        "reward/mean": float(scores.mean()) if all_scores else 0.0,
        "reward/std": float(scores.std(unbiased=False)) if all_scores else 0.0,
        "reward/max": float(scores.max()) if all_scores else 0.0,
        "data/sequences": float(len(kept)),
        "data/groups": float(len(parsed)),
        "data/dropped_groups": float(dropped_groups),
        "data/dropped_too_long": float(too_long),
        "data/missing_logprobs": float(sum(1 for s in kept if s.inference_logprobs is None)),
        "tokens/trained": float(sum(completion)),
        "tokens/total": float(sum(len(s.tokens) for s in kept)),
    }
    return PreparedBatch(
        micro_batches=micro,
        metrics=metrics,
        num_loss_tokens=int(sum(completion)),
        num_sequences=len(kept),
        max_completion_tokens=max(completion, default=0),
    )

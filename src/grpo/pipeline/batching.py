"""Groups → padded, causally shifted training micro-batches (the batcher).

One optimizer step's groups (`grpo.pipeline.group.Group`, the wire format) are screened, their rewards shaped, given
advantages (the advantage stage, `grpo.algorithms.advantages.step_advantages`), shifted for a causal LM, padded and
split into micro-batches. Every decision about the data (what is
dropped, what is missing) is counted in ``PreparedBatch.metrics`` so nothing is silently discarded.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from grpo.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator, GroupRewards, step_advantages
from grpo.algorithms.overlong import TruncationRule, masked_out
from grpo.pipeline.group import Group, MalformedGroup, parse_group
from grpo.trainer.train_batch import IGNORE_INDEX, PreparedBatch, TrainBatch

log = logging.getLogger(__name__)

# A log-probability is at most 0. A rollout log-prob above this at a completion token is impossible (the margin is
# for float rounding): probabilities, or garbage such as 1e6, sent in the field's place.
MAX_LOGPROB = 1e-3


class WarnOnce:
    """Logs the first case of each kind of degenerate data, naming the field; later ones are only counted in the
    batch's metrics (a bad environment would otherwise log every step)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, kind: str, message: str) -> None:
        if kind not in self.seen:
            self.seen.add(kind)
            log.warning("%s [counted in %s; warned once]", message, kind)


# Shared by every prepare_batch call that brings no WarnOnce of its own: once per process.
_WARN_ONCE = WarnOnce()


class BatchError(ValueError):
    """A group from the data source is malformed; the message names the group index and the field."""

    def __init__(self, group: int, field_name: str, msg: str):
        super().__init__(f"group {group}: field {field_name!r}: {msg}")
        self.group = group
        self.field = field_name


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
    # Stopped at the token limit (None = unknown) and that limit (None = not reported): grpo.algorithms.overlong.
    truncated: Optional[bool] = None
    max_new_tokens: Optional[int] = None


def _sequences(group: Group) -> list[_Seq]:
    return [
        _Seq(group.tokens[i], group.masks[i], group.scores[i], group.advantages[i], group.inference_logprobs[i],
             group.ref_logprobs[i], group.temperatures[i], group.zero_advantage[i],
             None if group.truncated is None else group.truncated[i], group.max_new_tokens)
        for i in range(len(group))
    ]


def _completion_tokens(s: _Seq) -> int:
    """Completion tokens of the sequence (its non-prompt positions), the length the overlong penalty reads."""
    return sum(1 for m in s.masks if m != IGNORE_INDEX)


def _shape_for_truncation(screened: list[list[_Seq]], rule: TruncationRule) -> dict[str, float]:
    """Add the soft overlong penalty to each sequence's score (before any advantage is computed from the scores);
    refuse sequences that lack what the rule reads (a clear error, not a silent no-op). The penalty's metrics."""
    penalties: list[float] = []
    for s in (s for seqs in screened for s in seqs):
        if rule.needs_truncation and s.truncated is None:
            raise ValueError("loss.mask_truncated=true needs rollouts that say which completions hit the token limit; "
                             "this data source does not (data=atropos sends no finish reasons): set "
                             "loss.mask_truncated=false")
        if rule.needs_length_limit:
            if s.max_new_tokens is None:
                raise ValueError("loss.overlong_buffer needs each group's completion-token limit, which this data "
                                 "source does not report (single-turn local rollouts do): set loss.overlong_buffer=null")
            penalty = rule.penalty(_completion_tokens(s), s.max_new_tokens)
            s.score += penalty
            penalties.append(penalty)
    if not rule.needs_length_limit:
        return {}
    return {"reward/overlong_penalty": sum(penalties) / len(penalties) if penalties else math.nan,
            "reward/overlong_penalized_fraction": (sum(p < 0 for p in penalties) / len(penalties)
                                                   if penalties else math.nan)}


def _loss_tokens(s: _Seq) -> int:
    """Tokens the loss sees: completion positions after the causal shift (the first token is never a label)."""
    return sum(1 for m in s.masks[1:] if m != IGNORE_INDEX)


def _impossible_logprob(s: _Seq) -> Optional[float]:
    """The first rollout log-prob above MAX_LOGPROB at a completion token, or None (prompt positions carry 1.0 by
    Atropos' convention and are never read)."""
    if s.inference_logprobs is None:
        return None
    return next((lp for lp, m in zip(s.inference_logprobs[1:], s.masks[1:]) if m != IGNORE_INDEX and lp > MAX_LOGPROB),
                None)


def _screen(parsed: list[tuple[int, list[_Seq]]], warn: Callable[[str, str], None]
            ) -> tuple[list[list[_Seq]], dict[str, int]]:
    """Degenerate data the wire format allows (parse_group checks the structure), counted per kind and warned once
    with the field named: groups with no loss token are dropped (nothing to train on); impossible rollout
    log-probs are treated as missing (the sequence trains as on-policy, as with null ones); a group of one sequence
    without server advantages is kept and counted (its advantage from `scores` is 0: no baseline)."""
    counts = {"data/no_loss_token_groups": 0, "data/impossible_logprobs": 0, "data/singleton_groups": 0}
    kept = []
    for gi, seqs in parsed:
        if not any(_loss_tokens(s) for s in seqs):
            counts["data/no_loss_token_groups"] += 1
            warn("data/no_loss_token_groups", f"group {gi}: field 'masks' marks every position as prompt "
                 f"({IGNORE_INDEX}): no token to train on; the group is dropped")
            continue
        for i, s in enumerate(seqs):
            bad = _impossible_logprob(s)
            if bad is not None:
                counts["data/impossible_logprobs"] += 1
                warn("data/impossible_logprobs", f"group {gi} sequence {i}: field 'inference_logprobs' has {bad:g} "
                     "at a completion token, but a log-probability is <= 0 (probabilities sent?); the row is treated "
                     "as missing (on-policy)")
                s.inference_logprobs = None
        if len(seqs) == 1 and seqs[0].advantage is None:
            counts["data/singleton_groups"] += 1
            warn("data/singleton_groups", f"group {gi} has one sequence and no 'advantages': its advantage from "
                 "'scores' is 0 (no baseline to compare with); use groups of 2 or more")
        kept.append(seqs)
    return kept, counts


def _is_zero(advantage: Any) -> bool:
    return all(a == 0.0 for a in advantage) if isinstance(advantage, list) else advantage == 0.0


def _parsed(gi: int, group: Group | dict, vocab_size: Optional[int]) -> Group:
    if isinstance(group, Group):
        return group
    try:
        return parse_group(group, vocab_size)
    except MalformedGroup as e:
        raise BatchError(gi, e.field, str(e).split(": ", 1)[-1]) from None


def _assign_advantages(screened: list[list[_Seq]], estimator: AdvantageEstimator) -> None:
    """The advantage stage on the step's screened groups (scores final): each sequence's ``advantage`` set."""
    rewards = [GroupRewards([s.score for s in seqs], [s.advantage for s in seqs], [s.zero_adv for s in seqs])
               for seqs in screened]
    for seqs, advantages in zip(screened, step_advantages(rewards, estimator)):
        for s, a in zip(seqs, advantages):
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
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    inf = torch.zeros((B, T), dtype=torch.float32)
    has_ref = any(s.ref_logprobs is not None for s in seqs)
    ref = torch.zeros((B, T), dtype=torch.float32) if has_ref else None
    adv = torch.zeros((B, T) if per_token_adv else (B,), dtype=torch.float32)
    for b, s in enumerate(seqs):
        L = len(s.tokens) - 1
        if L <= 0:
            continue
        toks = torch.tensor(s.tokens, dtype=torch.long)
        trained = torch.tensor(s.masks[1:], dtype=torch.long) != IGNORE_INDEX
        input_ids[b, :L] = toks[:-1]
        attention_mask[b, :L] = 1
        labels[b, :L] = torch.where(trained, toks[1:], torch.full_like(toks[1:], IGNORE_INDEX))
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
    loss_mask = (labels != IGNORE_INDEX).float()
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
    groups: Sequence[Group | dict],
    *,
    advantage_norm: str | AdvantageEstimator = "group",
    max_seq_len: int,
    micro_batch_size: int,
    pad_token_id: int,
    vocab_size: Optional[int] = None,
    warn: Optional[Callable[[str, str], None]] = None,
    truncation: Optional[TruncationRule] = None,
) -> PreparedBatch:
    """Turn one step's groups into causally shifted, padded micro-batches.

    - Groups arrive as `Group`s (validated by their pipeline) or as wire dicts, which `parse_group` validates here:
      a bad field raises ``BatchError`` naming the group and the field. An empty group is dropped
      (``data/dropped_groups``).
    - Advantages (the advantage stage, `grpo.algorithms.advantages.step_advantages`): the server's ``advantages``
      (per sequence or per token) when sent; else from ``scores`` by the estimator ``advantage_norm`` names (or
      ``advantage_norm`` itself, a function), on the whole group before too-long sequences are dropped, so the
      baseline sees every sample. A sequence's ``set_advantage_to_zero`` override zeroes its advantage.
    - Sequences longer than ``max_seq_len`` are dropped (``data/dropped_too_long``).
    - Null ``inference_logprobs`` (group or sequence) become NaN rows (``data/missing_logprobs`` counts them).
    - Degenerate data (``_screen``; each kind counted, and warned once through ``warn``, default once per process):
      groups without a loss token are dropped (``data/no_loss_token_groups``), sequences without one in other
      groups too (``data/no_loss_token_sequences``, after their score joined the baseline); rollout log-probs above
      0 at a completion token make that row missing (``data/impossible_logprobs``); groups of one sequence
      (``data/singleton_groups``) and groups whose advantages are all 0 (``data/zero_advantage_groups``, e.g. all
      scores equal) are kept, as GRPO trains on them (no policy gradient, but they count in the normalisers).
    - ``truncation`` (`grpo.algorithms.overlong`; the ``loss`` keys): the soft overlong penalty is added to each
      score before advantages (``reward/overlong_penalty``, the step's mean), so ``reward/mean`` and the advantages
      are of the shaped reward; with masking, truncated sequences are left out after their score joined the baseline
      (``data/masked_truncated``): no loss, no gradient, not in the normalisers.
    """
    estimator = ADVANTAGE_ESTIMATORS.resolve(advantage_norm, "advantage_norm")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    parsed = [(gi, _sequences(_parsed(gi, g, vocab_size))) for gi, g in enumerate(groups)]
    empty = sum(1 for _, seqs in parsed if not seqs)
    screened, degenerate = _screen([(gi, seqs) for gi, seqs in parsed if seqs], warn or _WARN_ONCE)
    rule = truncation or TruncationRule()
    truncation_metrics = _shape_for_truncation(screened, rule)
    all_scores = [s.score for seqs in screened for s in seqs]
    _assign_advantages(screened, estimator)
    kept, dropped = _kept_sequences(screened, max_seq_len, rule.mask_truncated)
    emptied = dropped.pop("emptied")
    per_token_adv = any(isinstance(s.advantage, list) for s in kept)
    micro = [
        _collate(kept[i : i + micro_batch_size], pad_token_id, per_token_adv)
        for i in range(0, len(kept), micro_batch_size)
    ]
    completion = [_loss_tokens(s) for s in kept]
    dropped_groups = empty + degenerate["data/no_loss_token_groups"] + emptied
    return PreparedBatch(
        micro_batches=micro,
        metrics={**_batch_metrics(all_scores, kept, completion, len(screened), dropped_groups,
                                  {**degenerate, **dropped}), **truncation_metrics},
        num_loss_tokens=int(sum(completion)),
        num_sequences=len(kept),
        max_completion_tokens=max(completion, default=0),
    )


def _batch_metrics(all_scores: list[float], kept: list, completion: list[int], groups: int, dropped_groups: int,
                   counts: dict[str, int]) -> dict[str, float]:
    """The step's data metrics: its rewards, what it kept and dropped (each degenerate kind counted), its tokens."""
    return {
        **_reward_metrics(all_scores),
        "data/sequences": float(len(kept)),
        "data/groups": float(groups),
        "data/dropped_groups": float(dropped_groups),
        **{k: float(v) for k, v in counts.items()},
        "data/missing_logprobs": float(sum(1 for s in kept if s.inference_logprobs is None)),
        "tokens/trained": float(sum(completion)),
        "tokens/total": float(sum(len(s.tokens) for s in kept)),
    }


def _kept_sequences(parsed: list[list[_Seq]], max_seq_len: int, mask_truncated: bool = False
                    ) -> tuple[list[_Seq], dict[str, int]]:
    """The sequences (advantages assigned) that fit ``max_seq_len``, have a loss token and are not masked as
    truncated: (kept, counts of too long sequences, sequences without a loss token, masked truncated sequences,
    zero-advantage groups, and groups emptied)."""
    kept: list[_Seq] = []
    counts = {"data/dropped_too_long": 0, "data/no_loss_token_sequences": 0, "data/zero_advantage_groups": 0,
              "emptied": 0}
    if mask_truncated:
        counts["data/masked_truncated"] = 0
    for seqs in parsed:
        group_kept = 0
        for s in seqs:
            if len(s.tokens) > max_seq_len:
                counts["data/dropped_too_long"] += 1
                continue
            if not _loss_tokens(s):
                counts["data/no_loss_token_sequences"] += 1
                continue
            if masked_out(s.truncated, mask_truncated):
                counts["data/masked_truncated"] += 1
                continue
            kept.append(s)
            group_kept += 1
        counts["data/zero_advantage_groups"] += all(_is_zero(s.advantage) for s in seqs)
        counts["emptied"] += group_kept == 0
    return kept, counts


def _reward_metrics(all_scores: list[float]) -> dict[str, float]:
    if not all_scores:  # no group to score: unknown (null in metrics.jsonl), not a reward of 0
        return {"reward/mean": math.nan, "reward/std": math.nan, "reward/max": math.nan}
    scores = torch.tensor(all_scores, dtype=torch.float64)
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std(unbiased=False)),
            "reward/max": float(scores.max())}

"""Prefix sharing (``train.prefix_sharing``): a micro-batch's sequences that start with the same prompt forward that
prompt once.

A GRPO group's completions share one prompt. ``shared_layout`` lays a micro-batch out as one row per distinct
prompt, ``[prompt, completion_1, ..., completion_n]``, with a 4D attention mask: prompt tokens attend causally within
the prompt, completion i's tokens to the whole prompt and causally to completion i's own earlier tokens, never to
another completion. Completion i's position ids continue from the prompt's end, as in its own sequence. Under causal
attention a prompt's hidden states do not depend on what follows, so every hidden state equals the unshared one;
``SharedLayout.index`` maps each position of the padded ``[B, T]`` micro-batch to its hidden state in the shared
rows, and gathering through it gives the padded layout back: the loss sees the same log-probs and masks, and the
gather's backward sums the completions' gradients into their one prompt copy, so gradients are the same too.

The prompt of a sequence is its positions before its first label (the last of them predicts the first completion
token); sequences share a row when those token ids are equal. Sequences of one micro-batch only: whichever of a
group's sequences a mini-batch shuffle puts in the same micro-batch share, the others forward their own copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.trainer.train_batch import IGNORE_INDEX


@dataclass
class SharedLayout:
    """A micro-batch as shared-prompt rows: ``input_ids`` and ``position_ids`` ``[R, S]``, ``allowed`` ``[R, 1, S, S]``
    (bool, True = query may attend to key), ``index`` ``[B, T]`` (each padded position's flat index into ``[R * S]``;
    0 at padding, which carries no label) and ``lengths`` (real tokens of each row)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    index: torch.Tensor
    lengths: list[int]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``allowed`` as the additive mask transformers' eager and SDPA kernels both take: 0, or the dtype's
        lowest value (exp() of it is 0, so a masked key has no weight)."""
        zero = torch.zeros((), dtype=dtype, device=self.allowed.device)
        return torch.where(self.allowed, zero, torch.finfo(dtype).min)


def prompt_lengths(attention_mask: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """Each row's prompt length: the positions up to and including its first label (at most its length)."""
    lengths = attention_mask.sum(1).tolist()
    labelled = labels != IGNORE_INDEX
    first = torch.where(labelled.any(1), labelled.float().argmax(1), attention_mask.shape[1]).tolist()
    return [min(int(f) + 1, int(n)) for f, n in zip(first, lengths)]


def _groups(input_ids: torch.Tensor, lengths: list[int], prompts: list[int]) -> list[list[int]]:
    """Rows of the micro-batch by prompt token ids (first appearance first); empty rows are left out."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for b, (n, p) in enumerate(zip(lengths, prompts)):
        if n > 0:
            by_prompt.setdefault(tuple(input_ids[b, :p].tolist()), []).append(b)
    return list(by_prompt.values())


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
          ) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """Each sequence's length and prompt length, the shared rows' sequences, and each row's tokens (a prompt once,
    then its sequences' completions)."""
    lengths = [int(n) for n in attention_mask.sum(1).tolist()]
    prompts = prompt_lengths(attention_mask, labels)
    groups = _groups(input_ids, lengths, prompts)
    return lengths, prompts, groups, [prompts[g[0]] + sum(lengths[b] - prompts[b] for b in g) for g in groups]


def shared_row_lengths(attention_mask: torch.Tensor, labels: torch.Tensor, input_ids: torch.Tensor) -> list[int]:
    """Tokens each shared row forwards (a prompt once, then its sequences' completions): what the FLOP count and
    the pad fraction see under prefix sharing."""
    return _rows(input_ids, attention_mask, labels)[3]


def shared_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> SharedLayout:
    """The shared-prompt rows of a right-padded, causally shifted micro-batch (module docstring)."""
    B, T = input_ids.shape
    lengths, prompts, groups, rows = _rows(input_ids, attention_mask, labels)
    R, S = max(len(groups), 1), max(rows, default=1)
    device = input_ids.device
    # Spans of the source sequences, in lists (a handful of tensor ops in all, not several per sequence): each
    # sequence's prompt goes to its row's start (written once, by the group's first sequence) and its completion
    # after its row's previous completions.
    spans = _Spans()
    for r, g in enumerate(groups):
        p = prompts[g[0]]
        at = p
        for k, b in enumerate(g, start=1):
            spans.add(b, 0, p, r, 0, branch=0, writes=k == 1)
            n = lengths[b] - p
            spans.add(b, p, n, r, at, branch=k, writes=True)
            at += n
    src_b, src_t, dst_r, dst_c, branch_of, writes = spans.positions(device)
    index = torch.zeros(B, T, dtype=torch.long, device=device)
    index[src_b, src_t] = dst_r * S + dst_c
    src_b, src_t, dst_r, dst_c, branch_of = (x[writes] for x in (src_b, src_t, dst_r, dst_c, branch_of))
    ids = input_ids.new_zeros(R, S)
    ids[dst_r, dst_c] = input_ids[src_b, src_t]
    pos = torch.zeros(R, S, dtype=torch.long, device=device)
    pos[dst_r, dst_c] = src_t  # a completion token keeps its position in its own sequence
    # Branch of each position: 0 = the prompt, k = the row's k-th completion, -1 = padding.
    branch = torch.full((R, S), -1, dtype=torch.long, device=device)
    branch[dst_r, dst_c] = branch_of
    bq, bk = branch[:, :, None], branch[:, None, :]
    allowed = (pos[:, None, :] <= pos[:, :, None]) & ((bk == 0) | (bk == bq)) & (bk >= 0)
    # A padding query attends to itself only: no softmax over an empty set (NaN), and no real query sees it.
    allowed |= torch.eye(S, dtype=torch.bool, device=device) & (bq < 0)
    return SharedLayout(ids, pos, allowed[:, None], index, rows)


class _Spans:
    """Runs of consecutive positions copied from a sequence into a shared row, expanded to per-position indices."""

    def __init__(self) -> None:
        self.cols: list[list[int]] = [[] for _ in range(7)]

    def add(self, b: int, start: int, n: int, r: int, at: int, branch: int, writes: bool) -> None:
        for col, value in zip(self.cols, (b, start, n, r, at, branch, int(writes))):
            col.append(value)

    def positions(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per position: source sequence and token, destination row and column, branch, and whether it is written."""
        b, start, n, r, at, branch, writes = (torch.tensor(c, dtype=torch.long, device=device) for c in self.cols)
        span = torch.repeat_interleave(torch.arange(len(n), device=device), n)
        offset = torch.arange(span.numel(), device=device) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        return b[span], start[span] + offset, r[span], at[span] + offset, branch[span], writes[span].bool()


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train on shared-prompt rows, or None. The 4D mask is taken as given, so a sliding
    attention window (which transformers would add to a mask it builds itself) would be lost."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    windowed = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if windowed or getattr(config, "use_sliding_window", False):
        return (f"{type(model).__name__} has sliding-window attention layers, which the shared rows' 4D mask does "
                "not apply")
    return None

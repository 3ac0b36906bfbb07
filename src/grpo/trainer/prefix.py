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

from grpo.trainer.batch import IGNORE_INDEX


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
    ids = input_ids.new_zeros(R, S)
    pos = torch.zeros(R, S, dtype=torch.long, device=input_ids.device)
    # Branch of each position: 0 = the prompt, k = the row's k-th completion, -1 = padding.
    branch = torch.full((R, S), -1, dtype=torch.long, device=input_ids.device)
    index = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)
    ar = torch.arange(T, device=input_ids.device)
    for r, g in enumerate(groups):
        p = prompts[g[0]]
        ids[r, :p], pos[r, :p], branch[r, :p] = input_ids[g[0], :p], ar[:p], 0
        index[g, :p] = r * S + ar[:p]
        at = p
        for k, b in enumerate(g, start=1):
            n = lengths[b] - p
            ids[r, at : at + n], pos[r, at : at + n] = input_ids[b, p : lengths[b]], ar[p : p + n]
            branch[r, at : at + n] = k
            index[b, p : lengths[b]] = r * S + at + torch.arange(n, device=input_ids.device)
            at += n
    bq, bk = branch[:, :, None], branch[:, None, :]
    allowed = (pos[:, None, :] <= pos[:, :, None]) & ((bk == 0) | (bk == bq)) & (bk >= 0)
    # A padding query attends to itself only: no softmax over an empty set (NaN), and no real query sees it.
    allowed |= torch.eye(S, dtype=torch.bool, device=input_ids.device) & (bq < 0)
    return SharedLayout(ids, pos, allowed[:, None], index, rows)


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

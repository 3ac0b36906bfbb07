"""Several policy updates per rollout batch: the batch's sequences split into shuffled mini-batches, one optimizer
step each, for `train.ppo_epochs` passes (PPO's epochs and mini-batches; TRL's num_iterations, verl's ppo_epochs and
ppo_mini_batch_size).

With one epoch and one mini-batch the rollout batch is used as it is, untouched, so the default run is exactly the
one-update-per-batch loop.

`train.max_tokens_per_micro_batch` re-splits each update's sequences by a token budget instead of a row count
(`token_budget_split`): the budget bounds the tokens each forward runs, padding included, in the layout it runs in
(under prefix sharing the shared rows, `[prompt, completion_1, ..., completion_n]`, not the sequences). Every loss normaliser (total tokens, total sequences, the Dr. GRPO divisor) is the whole
update's, carried on its `PreparedBatch`, so any partition of its rows into micro-batches sums to the same loss and
gradient: the split changes only the cost of the forward passes, never the result.
"""

from __future__ import annotations

import random
from typing import Optional

import torch

from grpo.schema.train import TrainConfig
from grpo.trainer.prefix import prompt_lengths, shared_row_lengths
from grpo.trainer.train_batch import IGNORE_INDEX, PreparedBatch, TrainBatch

# Padding value of each TrainBatch field when rows of different lengths are gathered into one micro-batch. Padded
# positions carry no loss (labels IGNORE_INDEX, loss_mask 0) and, right-padded, never influence earlier positions.
_PAD = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX, "loss_mask": 0.0, "inference_logprobs": 0.0,
        "ref_logprobs": float("nan"), "advantages": 0.0, "old_logprobs": 0.0}


def _fit(rows: torch.Tensor, length: int, pad: float) -> torch.Tensor:
    """Rows cut or right-padded with `pad` to `length` positions."""
    if rows.shape[1] >= length:
        return rows[:, :length]
    return torch.cat([rows, rows.new_full((rows.shape[0], length - rows.shape[1]), pad)], dim=1)


def gather_rows(micro_batches: list[TrainBatch], picks: list[tuple[int, int]]) -> TrainBatch:
    """One micro-batch of the rows `picks` ((micro-batch index, row index) pairs), right-padded to the longest."""
    # The rows of each source micro-batch in one indexing op, then put back in the order of `picks`.
    sources = sorted({m for m, _ in picks})
    rows_of = {m: [r for mm, r in picks if mm == m] for m in sources}
    starts, at = {}, 0
    for m in sources:
        starts[m], at = at, at + len(rows_of[m])
    seen = dict.fromkeys(sources, 0)
    order = []
    for m, _ in picks:
        order.append(starts[m] + seen[m])
        seen[m] += 1
    device = micro_batches[sources[0]].attention_mask.device
    index = {m: torch.tensor(rows_of[m], dtype=torch.long, device=device) for m in sources}
    length = max(max(int(micro_batches[m].attention_mask[index[m]].sum(1).max()) for m in sources), 1)
    permute = order != list(range(len(picks)))
    fields: dict[str, Optional[torch.Tensor]] = {}
    for name in TrainBatch.__dataclass_fields__:
        tensors = [getattr(micro_batches[m], name) for m in sources]
        if all(t is None for t in tensors):
            fields[name] = None
            continue
        parts = []
        for m, t in zip(sources, tensors):
            if t is None:  # this micro-batch has no such tensor (e.g. ref_logprobs): NaN = missing
                parts.append(torch.full((len(rows_of[m]), length), float("nan"), dtype=torch.float32, device=device))
            elif t.dim() == 1:  # per sequence: advantages [B], temperatures, scores
                parts.append(t[index[m]])
            else:
                parts.append(_fit(t[index[m]], length, _PAD.get(name, 0)))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        fields[name] = out[torch.tensor(order, device=device)] if permute else out
    return TrainBatch(**fields)


def _length(micro_batches: list[TrainBatch], pick: tuple[int, int]) -> int:
    m, r = pick
    return int(micro_batches[m].attention_mask[r].sum())


# A row's prompt under prefix sharing: (its prompt's token ids, the prompt's length); rows with equal keys share.
PromptKey = tuple[tuple[int, ...], int]


def _prompt_keys(micro_batches: list[TrainBatch], picks: list[tuple[int, int]]) -> list[PromptKey]:
    """Each pick's prompt as prefix sharing groups rows (grpo.trainer.prefix: the positions up to its first label)."""
    prompts = {m: prompt_lengths(micro_batches[m].attention_mask, micro_batches[m].labels) for m in {m for m, _ in picks}}
    return [(tuple(micro_batches[m].input_ids[r, :prompts[m][r]].tolist()), prompts[m][r]) for m, r in picks]


def forward_tokens(micro_batch: TrainBatch, padding_free: bool = False, shared: bool = False) -> tuple[int, int]:
    """(rows, width) of the decoder input one micro-batch forwards: its sequences x the longest when padded, one row
    of their summed lengths when packed, the shared rows x the longest shared row under prefix sharing."""
    if shared:
        rows = shared_row_lengths(micro_batch.attention_mask, micro_batch.labels, micro_batch.input_ids)
        return len(rows), max(rows, default=0)
    lengths = micro_batch.attention_mask.sum(dim=1).tolist()
    if padding_free:
        return 1, int(sum(lengths))
    return len(lengths), int(max(lengths, default=0))


def token_budget_groups(lengths: list[int], max_tokens: int, padding_free: bool = False,
                        prompts: Optional[list[PromptKey]] = None) -> list[list[int]]:
    """Indices of `lengths` grouped into micro-batches of at most `max_tokens` forward tokens each.

    Longest first (so rows of similar length share a micro-batch and pad little), each micro-batch filled while its
    cost fits: `rows x longest row` when padded, the sum of the lengths when packed (`padding_free`). With `prompts`
    (prefix sharing: each row's PromptKey) the cost is that of the shared rows the forward runs (`shared rows x
    longest shared row`, a shared row being its prompt once and its sequences' completions), and a prompt's
    sequences are taken together. A row longer than the budget gets a micro-batch of its own. Deterministic: ties
    keep their order.
    """
    if prompts is not None:
        return _shared_budget_groups(lengths, prompts, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    cost = 0
    for i in order:
        add = lengths[i] if padding_free else lengths[groups[-1][0]] if groups else lengths[i]
        if groups and cost + add <= max_tokens:
            groups[-1].append(i)
            cost += add
        else:
            groups.append([i])
            cost = lengths[i]
    return groups


def _shared_budget_groups(lengths: list[int], prompts: list[PromptKey], max_tokens: int) -> list[list[int]]:
    """token_budget_groups under prefix sharing: prompts by their shared row's length (longest first), each
    prompt's rows longest first, a micro-batch filled while its shared rows x longest shared row fits."""
    by_prompt: dict[PromptKey, list[int]] = {}
    for i, key in enumerate(prompts):
        by_prompt.setdefault(key, []).append(i)
    shared = {key: key[1] + sum(lengths[i] - key[1] for i in rows) for key, rows in by_prompt.items()}
    order = [i for key in sorted(by_prompt, key=lambda k: -shared[k])
             for i in sorted(by_prompt[key], key=lambda i: -lengths[i])]
    groups: list[list[int]] = []
    rows: dict[PromptKey, int] = {}  # the open micro-batch's shared rows and their lengths
    for i in order:
        key = prompts[i]
        grown = rows.get(key, key[1]) + lengths[i] - key[1]
        cost = (len(rows) + (key not in rows)) * max(grown, *rows.values(), 0)
        if groups and cost <= max_tokens:
            groups[-1].append(i)
            rows[key] = grown
        else:
            groups.append([i])
            rows = {key: lengths[i]}
    return groups


def _micro_split(
    micro_batches: list[TrainBatch], picks: list[tuple[int, int]], micro_batch_size: int,
    max_tokens: Optional[int], padding_free: bool, shared: bool = False,
) -> list[TrainBatch]:
    """`picks` as micro-batches: `micro_batch_size` rows each, or by the token budget when `max_tokens` is set (in
    the shared rows' layout when `shared`)."""
    if max_tokens is None:
        return [gather_rows(micro_batches, picks[i : i + micro_batch_size])
                for i in range(0, len(picks), micro_batch_size)]
    lengths = [_length(micro_batches, p) for p in picks]
    prompts = _prompt_keys(micro_batches, picks) if shared else None
    return [gather_rows(micro_batches, [picks[i] for i in group])
            for group in token_budget_groups(lengths, max_tokens, padding_free, prompts)]


def token_budget_split(batch: PreparedBatch, max_tokens: int, padding_free: bool = False,
                       shared: bool = False) -> PreparedBatch:
    """The same update with its rows re-split into micro-batches of at most `max_tokens` forward tokens
    (`token_budget_groups`; `shared`: counted in prefix sharing's shared rows); normalisers and metrics are the
    batch's, so loss and gradients are unchanged."""
    picks = [(m, r) for m, mb in enumerate(batch.micro_batches) for r in range(mb.num_sequences)]
    micro = _micro_split(batch.micro_batches, picks, 0, max_tokens, padding_free, shared)
    return PreparedBatch(micro_batches=micro, metrics=batch.metrics, num_loss_tokens=batch.num_loss_tokens,
                         num_sequences=batch.num_sequences, max_completion_tokens=batch.max_completion_tokens)


def capped_split(batch: PreparedBatch, max_tokens: int, padding_free: bool = False,
                 shared: bool = False) -> PreparedBatch:
    """The same update with each micro-batch whose forward runs more than `max_tokens` tokens (`forward_tokens`)
    re-split by that budget (`token_budget_groups`); the others are kept as they are. `batch` itself when none is
    over: a cap above every micro-batch changes nothing (train.auto_token_budget)."""
    if all(rows * width <= max_tokens for rows, width in
           (forward_tokens(mb, padding_free, shared) for mb in batch.micro_batches)):
        return batch
    micro: list[TrainBatch] = []
    for m, mb in enumerate(batch.micro_batches):
        rows, width = forward_tokens(mb, padding_free, shared)
        if rows * width <= max_tokens or mb.num_sequences == 1:
            micro.append(mb)
        else:
            picks = [(m, r) for r in range(mb.num_sequences)]
            micro += _micro_split(batch.micro_batches, picks, 0, max_tokens, padding_free, shared)
    return PreparedBatch(micro_batches=micro, metrics=batch.metrics, num_loss_tokens=batch.num_loss_tokens,
                         num_sequences=batch.num_sequences, max_completion_tokens=batch.max_completion_tokens)


def without_zero_advantage_rows(
    batch: PreparedBatch, micro_batch_size: int, max_tokens: Optional[int] = None, padding_free: bool = False,
    shared: bool = False,
) -> PreparedBatch:
    """The same update without its rows whose advantage is 0 at every token (how many were left out:
    `num_sequences` minus the rows of its micro-batches).

    For a loss where such a row adds nothing to the loss or its gradient (GRPO without KL: each term is a multiple of
    the advantage), the update is unchanged: normalisers stay the update's, kept rows keep their order (a group's
    completions stay together for prefix sharing). One row stays when all are zero, so the optimizer still steps on
    zero gradients (AdamW moves on its momentum; a parameter without a gradient would not move at all).
    """
    picks = [(m, r) for m, mb in enumerate(batch.micro_batches)
             for r in (mb.advantages != 0).reshape(mb.num_sequences, -1).any(1).nonzero().flatten().tolist()]
    if len(picks) == sum(mb.num_sequences for mb in batch.micro_batches):
        return batch
    micro = _micro_split(batch.micro_batches, picks or [(0, 0)], micro_batch_size, max_tokens, padding_free, shared)
    return PreparedBatch(micro_batches=micro, metrics=batch.metrics, num_loss_tokens=batch.num_loss_tokens,
                         num_sequences=batch.num_sequences, max_completion_tokens=batch.max_completion_tokens)


def split_mini_batches(
    batch: PreparedBatch, mini_batches: int, micro_batch_size: int, rng: random.Random,
    max_tokens: Optional[int] = None, padding_free: bool = False, shared: bool = False,
) -> list[PreparedBatch]:
    """The rollout batch's sequences shuffled by `rng` and split into `mini_batches` mini-batches (sizes differ by
    at most one), each in micro-batches of at most `micro_batch_size` rows, normalised by its own token and sequence
    counts (or by the token budget `max_tokens`, see `token_budget_groups`). The Dr. GRPO divisor stays the
    rollout batch's longest completion."""
    picks = [(m, r) for m, mb in enumerate(batch.micro_batches) for r in range(mb.num_sequences)]
    if mini_batches > len(picks):
        raise ValueError(f"train.mini_batches={mini_batches} exceeds the {len(picks)} sequences of the rollout batch")
    rng.shuffle(picks)
    out = []
    for k in range(mini_batches):
        mine = picks[k * len(picks) // mini_batches : (k + 1) * len(picks) // mini_batches]
        micro = _micro_split(batch.micro_batches, mine, micro_batch_size, max_tokens, padding_free, shared)
        out.append(PreparedBatch(
            micro_batches=micro, metrics={}, num_loss_tokens=sum(mb.num_loss_tokens for mb in micro),
            num_sequences=len(mine), max_completion_tokens=batch.max_completion_tokens,
        ))
    return out


def update_plan(
    batch: PreparedBatch, ppo_epochs: int, mini_batches: int, seed: int, batch_number: int,
    max_tokens: Optional[int] = None, padding_free: bool = False, shared: bool = False,
) -> list[tuple[int, PreparedBatch]]:
    """(epoch, mini-batch) of every optimizer step of one rollout batch, in order. Shuffles use their own
    generator seeded by (run seed, batch number, epoch), so no other random stream moves and resume replays them.
    `max_tokens` sets the micro-batches by a token budget (`token_budget_groups`, in prefix sharing's rows when
    `shared`); None keeps the row count."""
    if ppo_epochs == 1 and mini_batches == 1:
        return [(0, batch if max_tokens is None else token_budget_split(batch, max_tokens, padding_free, shared))]
    plan = []
    for epoch in range(ppo_epochs):
        rng = random.Random(f"grpo-minibatch:{seed}:{batch_number}:{epoch}")
        minis = split_mini_batches(batch, mini_batches, batch.micro_batch_size, rng, max_tokens, padding_free, shared)
        plan += [(epoch, mb) for mb in minis]
    return plan


def updates_per_batch(train_cfg: TrainConfig) -> int:
    """Optimizer steps per rollout batch: `train.ppo_epochs` passes x `train.mini_batches` mini-batches."""
    return int(train_cfg.ppo_epochs) * int(train_cfg.mini_batches)


def rollout_batches(train_cfg: TrainConfig, start_step: int, start_batch: Optional[int]) -> tuple[int, int]:
    """(the first rollout batch of this session, the rollout batches of the run): what a data source counts (its
    `step`, run-api's step). `start_batch` is the checkpoint's own count; older checkpoints have only the step."""
    per_batch = updates_per_batch(train_cfg)
    first = start_step // per_batch if start_batch is None else start_batch
    return first, int(train_cfg.steps) // per_batch

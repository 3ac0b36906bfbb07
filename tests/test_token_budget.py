"""train.max_tokens_per_micro_batch bounds what each forward runs, padding included, in the layout it runs in: under
prefix sharing the shared rows ([prompt, completion_1, ..., completion_n], one per distinct prompt), which a budget
on the sequences let grow to twice the budget; pi_old's recompute forwards the same budgeted micro-batches; an
out-of-memory error names the largest micro-batch as its forward ran it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from grpo.pipeline.batching import prepare_batch
from grpo.pipeline.group import Group
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.prefix import shared_row_lengths
from test_packing import _model, update_trainer
from test_ppo_updates import _rows, _trainer

BUDGET = 6144


def _long_answers(n_groups: int = 12, group_size: int = 8, seed: int = 0) -> list[Group]:
    """Chat-arithmetic-like groups: a 60-token prompt, completions either short or 531 tokens long (cut at the cap),
    as a real model that sometimes explains at length writes them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        prompt = [rng.randrange(3, 250) for _ in range(60)]
        comps = [[rng.randrange(3, 250) for _ in range(rng.choice([rng.randrange(3, 40), 531]))]
                 for _ in range(group_size)]
        out.append(Group.sampled(prompt, comps, [[-1.0] * len(c) for c in comps],
                                 [float(j % 2) for j in range(group_size)], 1.0))
    return out


def _shared_cost(mb) -> int:
    rows = shared_row_lengths(mb.attention_mask, mb.labels, mb.input_ids)
    return len(rows) * max(rows)


@pytest.mark.parametrize("skip_zero_advantage", [False, True])
def test_the_budget_holds_in_prefix_sharings_rows(tiny_qwen2_dir, skip_zero_advantage):
    batch = prepare_batch(_long_answers(), max_seq_len=1024, micro_batch_size=128, pad_token_id=0)
    trainer = update_trainer(_model(tiny_qwen2_dir), GRPOLoss(), prefix_sharing=True, max_tokens_per_micro_batch=BUDGET,
                             skip_zero_advantage=skip_zero_advantage)
    ((_, mini),) = trainer.plan(batch)
    costs = [_shared_cost(mb) for mb in mini.micro_batches]
    assert max(costs) <= BUDGET, costs  # the sequences' budget alone let the shared rows reach 16260 tokens
    assert sum(mb.num_sequences for mb in mini.micro_batches) == batch.num_sequences
    # Sharing still pays: a micro-batch holds more sequences than the padded budget would allow (6144 / 590 = 10).
    assert max(mb.num_sequences for mb in mini.micro_batches) > BUDGET // 590


def test_the_out_of_memory_message_names_the_largest_forward_not_two_maxima(tiny_qwen2_dir):
    """The message said 'up to R sequences x L tokens' with R the most rows of any micro-batch and L the longest row
    of any: under a budget those come from different micro-batches (many short rows, few long ones), so it reported
    60 x 591 = 35k tokens for micro-batches of at most 16384."""
    from grpo.trainer.out_of_memory import TrainerOutOfMemoryError

    class OutOfMemoryLoss(GRPOLoss):
        def __call__(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory.")

    batch = prepare_batch(_long_answers(8), max_seq_len=1024, micro_batch_size=128, pad_token_id=0)
    trainer = update_trainer(_model(tiny_qwen2_dir), OutOfMemoryLoss(), max_tokens_per_micro_batch=4096)
    ((_, mini),) = trainer.plan(batch)
    largest = max(mini.micro_batches, key=lambda mb: mb.input_ids.numel())
    with pytest.raises(TrainerOutOfMemoryError) as e:
        trainer.update(mini)
    tokens = int(largest.num_sequences * largest.attention_mask.sum(1).max())
    assert tokens <= 4096
    assert (f"micro-batch of {tokens} tokens ({largest.num_sequences} sequences x "
            f"{int(largest.attention_mask.sum(1).max())} tokens, padded)") in str(e.value)


def test_pi_old_is_recomputed_on_budgeted_micro_batches(tiny_qwen2_dir, tmp_path):
    """The recompute (and the KL reference's forward) ran on the rollout batch's micro_batch_size rows whatever the
    budget; it forwards the budgeted micro-batches now."""
    budget = 12  # the rollout batch's micro-batches are 2 rows of 7 to 10 tokens: above it
    trainer = _trainer(tiny_qwen2_dir, tmp_path / "run", steps=1, loss=GRPOLoss(old_logprobs="recompute"),
                       max_tokens_per_micro_batch=budget)
    forwards: list[tuple[int, int]] = []
    inner = trainer.token_logprobs

    def recorded(input_ids, attention_mask, *args, **kwargs):
        lengths = attention_mask.sum(1)
        forwards.append((int(lengths.numel()), int(lengths.max())))
        return inner(input_ids, attention_mask, *args, **kwargs)

    trainer.token_logprobs = recorded
    trainer.fit()
    trainer.metrics.close()
    assert _rows(tmp_path / "run")[0]["grpo/ratio_old_mean"] == pytest.approx(1.0, abs=1e-6)
    assert forwards and all(rows * longest <= budget or rows == 1 for rows, longest in forwards), forwards


# --------------------------------------------------------------------- the default bound (train.auto_token_budget)
class _Decoder(torch.nn.Module):
    """A module with a decoder's config sizes (SmolLM2-135M's) and a few float32 parameters."""

    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
        self.weight = torch.nn.Parameter(torch.zeros(1000))
        self.is_gradient_checkpointing = checkpointing


def test_the_cap_is_derived_from_the_free_memory_and_the_models_size():
    from grpo.trainer.token_cap import CPU_TOKEN_CAP, derived_token_cap

    assert derived_token_cap(_Decoder(), torch.device("cpu"))[0] == CPU_TOKEN_CAP
    # The H100: vLLM holding 0.25 of 80 GB, about 58 GiB free when the trainer starts.
    cap, how = derived_token_cap(_Decoder(), torch.device("cuda"), free_bytes=58 * 2**30)
    assert 8192 <= cap <= 20480 and "58.0 GiB free" in how
    assert cap < 128 * 591  # micro_batch_size 128 of 591-token sequences, which ran out of memory, is split
    half, _ = derived_token_cap(_Decoder(), torch.device("cuda"), free_bytes=29 * 2**30)
    assert half == pytest.approx(cap / 2, abs=1024)
    assert derived_token_cap(_Decoder(checkpointing=True), torch.device("cuda"), free_bytes=58 * 2**30)[0] > 4 * cap


def test_micro_batches_over_the_cap_are_split_and_the_others_kept(tiny_qwen2_dir, caplog):
    import logging

    from grpo.trainer.token_cap import CPU_TOKEN_CAP

    with caplog.at_level(logging.INFO, logger="grpo.trainer.token_cap"):
        trainer = update_trainer(_model(tiny_qwen2_dir), GRPOLoss(), micro_batch_size=128)
    assert trainer.token_cap == CPU_TOKEN_CAP
    assert (f"micro-batches: 128 rows (train.micro_batch_size), split further where a forward would run more than "
            f"{CPU_TOKEN_CAP} tokens (train.auto_token_budget: the CPU default") in caplog.text
    long = prepare_batch(_long_answers(16), max_seq_len=1024, micro_batch_size=128, pad_token_id=0)
    assert max(mb.input_ids.numel() for mb in long.micro_batches) > CPU_TOKEN_CAP  # 128 x 590
    ((_, split),) = trainer.plan(long)
    assert max(mb.input_ids.numel() for mb in split.micro_batches) <= CPU_TOKEN_CAP
    assert split.num_sequences == long.num_sequences == sum(mb.num_sequences for mb in split.micro_batches)
    short = prepare_batch(_long_answers(16, seed=1)[:2], max_seq_len=1024, micro_batch_size=128, pad_token_id=0)
    ((_, same),) = trainer.plan(short)
    assert same is short  # under the cap: the batcher's micro-batches, untouched
    off = update_trainer(_model(tiny_qwen2_dir), GRPOLoss(), micro_batch_size=128, auto_token_budget=False)
    assert off.token_cap is None and off.plan(long)[0][1] is long


def test_the_default_jobs_micro_batches_are_under_the_cpu_cap():
    """`python train.py`'s micro-batches (micro_batch_size rows of at most model.max_seq_len tokens) can never
    exceed the CPU cap, so the default job splits, and computes, exactly as before."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.conf import CONFIG_DIR
    from grpo.config import register_configs
    from grpo.trainer.token_cap import CPU_TOKEN_CAP

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train")
    assert cfg.train.auto_token_budget and cfg.train.max_tokens_per_micro_batch is None
    assert cfg.train.micro_batch_size * cfg.model.max_seq_len <= CPU_TOKEN_CAP

"""Completions cut by the length limit: loss.mask_truncated and DAPO's soft overlong penalty (loss.overlong_buffer),
on hand-made batches, and their metrics in a short train.py run."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithms.advantages import group_normalized
from grpo.algorithms.overlong import TruncationRule, soft_overlong_penalty
from grpo.pipeline.batching import prepare_batch
from grpo.pipeline.group import Group
from grpo.pipeline.multi_turn import trajectory_group
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.train_batch import IGNORE_INDEX
from test_packing import update_trainer
from test_prefix_sharing import _grads, _model

LIMIT = 8


def _truncated_groups() -> list[Group]:
    """Three groups of 4, sampled under an 8-token limit: completions of 8 tokens are truncated (no EOS), except the
    one of group 1 that ended with EOS at exactly 8; group 2 has no truncated completion."""
    g = torch.Generator().manual_seed(1)
    spec = [  # (completion lengths, truncated flags, scores)
        ([2, 8, 5, 8], [False, True, False, True], [1.0, 0.0, 0.5, 1.0]),
        ([3, 8, 6, 8], [False, False, False, True], [0.0, 1.0, 1.0, 0.2]),
        ([1, 4, 7, 2], [False, False, False, False], [0.3, 0.9, 0.1, 0.6]),
    ]
    out = []
    for k, (lengths, truncated, scores) in enumerate(spec):
        prompt = torch.randint(3, 250, (3 + k,), generator=g).tolist()
        comps = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]
        lps = [[-1.5 - 0.05 * i for i in range(n)] for n in lengths]
        out.append(Group.sampled(prompt, comps, lps, scores, 1.0, truncated=truncated, max_new_tokens=LIMIT))
    return out


def _prepare(groups, truncation=None, micro_batch_size=3):
    return prepare_batch(groups, max_seq_len=64, micro_batch_size=micro_batch_size, pad_token_id=0,
                         truncation=truncation)


# ---------------------------------------------------------------- the soft penalty
@pytest.mark.parametrize("length, expected", [
    (1, 0.0), (12, 0.0),            # below the buffer: no penalty
    (13, -0.25), (14, -0.5), (15, -0.75),  # inside it: linear
    (16, -1.0), (17, -1.0),         # at the limit (and past it): -factor
])
def test_soft_penalty_below_inside_and_at_the_end_of_the_buffer(length, expected):
    assert soft_overlong_penalty(length, max_length=16, buffer=4, factor=1.0) == pytest.approx(expected)
    assert soft_overlong_penalty(length, max_length=16, buffer=4, factor=0.5) == pytest.approx(expected / 2)


def test_a_buffer_longer_than_the_limit_spans_the_whole_completion():
    assert soft_overlong_penalty(0, 4, 10, 1.0) == 0.0
    assert soft_overlong_penalty(2, 4, 10, 1.0) == pytest.approx(-0.5)
    assert soft_overlong_penalty(4, 4, 10, 1.0) == pytest.approx(-1.0)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="loss.overlong_buffer must be >= 1"):
        GRPOLoss(overlong_buffer=0)
    with pytest.raises(ValueError, match="loss.overlong_penalty_factor must be >= 0"):
        GRPOLoss(overlong_buffer=4, overlong_penalty_factor=-1.0)
    assert GRPOLoss(mask_truncated=True, overlong_buffer=4).truncation == TruncationRule(True, 4, 1.0)


# ---------------------------------------------------------------- shaped rewards → advantages
def test_the_advantage_is_computed_from_the_shaped_reward():
    """Equal raw rewards: without the penalty every advantage is 0; with it, the longer completions rank lower."""
    group = Group.sampled([5, 6], [[7] * 2, [8] * 5, [9] * 7, [10] * 8], [None] * 4, [1.0] * 4, 1.0,
                          truncated=[False, False, False, True], max_new_tokens=LIMIT)
    plain = _prepare([group], micro_batch_size=8)
    assert plain.micro_batches[0].advantages.abs().max() == 0
    assert "reward/overlong_penalty" not in plain.metrics
    rule = TruncationRule(overlong_buffer=4, overlong_penalty_factor=1.0)
    shaped = _prepare([group], rule, micro_batch_size=8)
    penalties = [0.0, -0.25, -0.75, -1.0]  # lengths 2, 5, 7, 8; the buffer is tokens 5..8
    rewards = torch.tensor([1.0 + p for p in penalties], dtype=torch.float64)
    torch.testing.assert_close(shaped.micro_batches[0].advantages,
                               group_normalized(rewards, rewards).float(), rtol=0, atol=1e-6)
    assert shaped.metrics["reward/overlong_penalty"] == pytest.approx(sum(penalties) / 4)
    assert shaped.metrics["reward/overlong_penalized_fraction"] == pytest.approx(0.75)
    assert shaped.metrics["reward/mean"] == pytest.approx(float(rewards.mean()))
    assert group.scores == [1.0] * 4  # the group itself is left as it came (a resumed or re-read batch is unchanged)


# ---------------------------------------------------------------- masking truncated completions
def _reference_without_truncated(groups: list[Group]):
    """The batch of the untruncated completions alone, with the advantages they get in their whole groups (the
    truncated ones' rewards join the baseline): what masking must train on."""
    full = _prepare(groups, micro_batch_size=64).micro_batches[0].advantages.tolist()
    kept, i = [], 0
    for g in groups:
        keep = [j for j in range(len(g)) if not g.truncated[j]]
        adv = full[i:i + len(g)]
        i += len(g)
        n = g.masks[0].count(IGNORE_INDEX)  # prompt length
        sub = Group.sampled(g.tokens[0][:n], [g.tokens[j][n:] for j in keep],
                            [g.inference_logprobs[j][n:] for j in keep], [g.scores[j] for j in keep], 1.0)
        sub.advantages = [adv[j] for j in keep]
        kept.append(sub)
    return _prepare(kept)


@pytest.mark.parametrize("prefix_sharing, fused, aggregation", [
    (False, True, "token_mean"), (False, False, "seq_mean_token_mean"), (True, True, "token_mean"),
    (True, True, "seq_mean_token_sum_norm")])
def test_mask_zeroes_exactly_the_truncated_completions_loss_and_gradient(tiny_qwen2_dir, prefix_sharing, fused,
                                                                          aggregation):
    """With loss.mask_truncated the step's loss and gradients are those of the untruncated completions alone (with
    their advantages from the whole group); without it the truncated ones change both."""
    model = _model(tiny_qwen2_dir)
    loss_fn = GRPOLoss(aggregation=aggregation, mask_truncated=True)
    trainer = update_trainer(model, loss_fn, fused_loss=fused, prefix_sharing=prefix_sharing)
    groups = _truncated_groups()
    masked = _prepare(groups, loss_fn.truncation)
    assert masked.metrics["data/masked_truncated"] == 3
    assert masked.num_sequences == 9
    loss_masked, _ = trainer.forward_backward(masked)
    grads_masked = _grads(model)
    reference = _reference_without_truncated(groups)
    assert reference.num_loss_tokens == masked.num_loss_tokens  # the normalisers count the kept rows alone
    loss_ref, _ = trainer.forward_backward(reference)
    grads_ref = _grads(model)
    assert loss_masked == pytest.approx(loss_ref, rel=1e-5, abs=1e-7)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads_masked[name], g, rtol=1e-5, atol=1e-6, msg=name)
    loss_all, _ = trainer.forward_backward(_prepare(groups))
    grads_all = _grads(model)
    assert abs(loss_all - loss_ref) > 1e-4
    assert max((grads_all[n] - g).abs().max().item() for n, g in grads_ref.items()) > 1e-4


def test_masked_groups_keep_their_baseline_and_an_all_truncated_group_is_dropped():
    groups = _truncated_groups()
    groups[2].truncated = [True] * 4
    batch = _prepare(groups, TruncationRule(mask_truncated=True), micro_batch_size=64)
    assert batch.metrics["data/masked_truncated"] == 7
    assert batch.metrics["data/dropped_groups"] == 1
    # Group 0's kept completions (scores 1.0 and 0.5) are ranked against all four rewards [1, 0, 0.5, 1].
    expected = group_normalized(torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64), torch.zeros(1))
    torch.testing.assert_close(batch.micro_batches[0].advantages[:2], expected[[0, 2]].float(), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- sources that cannot say
def test_sources_without_truncation_or_a_limit_are_refused_by_name():
    wire = Group.sampled([5, 6], [[7, 8], [9]], [None, None], [1.0, 0.0], 1.0).to_wire()  # as Atropos sends it
    with pytest.raises(ValueError, match="loss.mask_truncated=false"):
        _prepare([wire], TruncationRule(mask_truncated=True))
    assert not math.isnan(_prepare([wire], TruncationRule()).metrics["reward/mean"])

    from grpo.tasks.environment import MAX_TOKENS, Trajectory
    from grpo.tasks.prompts import Prompt

    t = Trajectory.start(Prompt("p"), None, [5, 6], logprobs=True)
    t.add_model_turn([7, 8], [-1.0, -1.0], "length", (0, 0))
    t.end = MAX_TOKENS
    group = trajectory_group([t, t], [1.0, 0.0], 1.0)
    assert group.truncated == [True, True] and group.max_new_tokens is None
    with pytest.raises(ValueError, match="loss.overlong_buffer=null"):
        _prepare([group], TruncationRule(overlong_buffer=2))


@pytest.mark.parametrize("overrides, needle", [
    (["data=atropos", "loss.mask_truncated=true"], "set loss.mask_truncated=false"),
    (["data=atropos", "loss.overlong_buffer=4"], "set loss.overlong_buffer=null"),
    (["data=calculator", "loss.overlong_buffer=4"], "MultiTurnPipeline reports no single completion-token limit"),
])
def test_the_config_check_refuses_a_source_that_cannot_say_before_anything_starts(tmp_path, overrides, needle):
    from grpo.config import ConfigError
    from test_config_checks import _validate

    with pytest.raises(ConfigError, match=needle):
        _validate(["~experiment", *overrides], tmp_path)


def test_the_config_check_passes_the_sources_that_can(tmp_path):
    from test_config_checks import _validate

    _validate(["~experiment", "loss.mask_truncated=true", "loss.overlong_buffer=4"], tmp_path)
    _validate(["~experiment", "data=calculator", "loss.mask_truncated=true"], tmp_path)


# ---------------------------------------------------------------- a short train.py run
@pytest.mark.vllm
def test_a_short_run_with_both_options_logs_their_metrics(tmp_path, train_server, tiny_qwen2_dir):
    """The bare tiny job with a 64-token limit, which most of the random model's completions reach, asynchronous
    rollouts and prefix sharing: truncated completions are masked, the rest train, and the soft penalty shapes the
    rewards; every step's row says so."""
    from test_train_e2e import QUICK, attach, metrics, run_train

    run_dir = tmp_path / "run"
    external, env = attach(train_server, tiny_qwen2_dir)
    out, _ = run_train(*QUICK, "train.steps=2", "data.max_new_tokens=64", "loss.mask_truncated=true",
                       "loss.overlong_buffer=16", "loss.overlong_penalty_factor=0.5", "train.max_staleness=1",
                       "train.prefix_sharing=true", external, f"hydra.run.dir={run_dir}", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in metrics(run_dir) if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        sequences = 16  # 4 prompts x 4 completions
        assert r["completion/truncated_fraction"] > 0
        assert r["data/masked_truncated"] == round(r["completion/truncated_fraction"] * sequences)
        assert r["data/sequences"] == sequences - r["data/masked_truncated"]
        # A truncated completion has 64 tokens, at the end of the buffer: -0.5; a shorter one less or none.
        assert -0.5 <= r["reward/overlong_penalty"] <= -0.5 * r["completion/truncated_fraction"]
    # Some completions ended with EOS: those rows trained (through prefix sharing), the truncated ones did not.
    assert any(r["data/sequences"] > 0 and r["loss"] is not None for r in rows), rows

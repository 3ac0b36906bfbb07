"""Issue 21 item 4: degenerate data the wire format allows is counted per kind (`data/...`), warned about once with
the field named, and dropped when nothing in it can be trained on; a step left with nothing to train on is skipped
and counted, its loss null rather than 0. Groups are built as an Atropos environment builds them (tests/test_batch.py)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from grpo.pipeline.batching import WarnOnce
from test_batch import make_group, prep

DEGENERATE_KEYS = ("data/no_loss_token_groups", "data/no_loss_token_sequences", "data/impossible_logprobs",
                   "data/singleton_groups", "data/zero_advantage_groups")


def all_prompt(group: dict) -> dict:
    """The group with every position masked as prompt: no token to train on."""
    return {**group, "masks": [[-100] * len(m) for m in group["masks"]]}


def counts(batch) -> dict[str, float]:
    return {k: batch.metrics[k] for k in DEGENERATE_KEYS}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_ordinary_groups_count_nothing_degenerate():
    pb = prep([make_group([1, 2], [[5, 6], [7]], [1.0, 0.0]), make_group([3], [[8], [9, 10]], [0.0, 0.5])],
              warn=WarnOnce())
    assert counts(pb) == dict.fromkeys(DEGENERATE_KEYS, 0.0)
    assert pb.metrics["data/dropped_groups"] == 0 and pb.num_sequences == 4


def test_a_group_with_every_mask_prompt_is_dropped_counted_and_warned_once(caplog):
    good = make_group([1, 2], [[5, 6], [7]], [1.0, 0.0])
    warn = WarnOnce()
    with caplog.at_level(logging.WARNING):
        pb = prep([all_prompt(make_group([1], [[5], [6]], [1.0, 0.0])), good], warn=warn)
        again = prep([all_prompt(good), good], warn=warn)
    assert pb.metrics["data/no_loss_token_groups"] == 1 and pb.metrics["data/dropped_groups"] == 1
    assert pb.num_sequences == 2 and pb.metrics["data/groups"] == 1
    # Its scores are not in the step's reward: only the trained group's are.
    assert pb.metrics["reward/mean"] == 0.5
    assert again.metrics["data/no_loss_token_groups"] == 1
    (message,) = warnings_of(caplog)
    assert "group 0" in message and "'masks'" in message and "data/no_loss_token_groups" in message


def test_a_sequence_without_loss_tokens_joins_the_baseline_but_is_not_trained():
    g = make_group([1, 2], [[5, 6], [7], [8]], [1.0, 0.0, 0.5])
    g["masks"][2] = [-100] * len(g["masks"][2])
    pb = prep([g], warn=WarnOnce())
    assert pb.metrics["data/no_loss_token_sequences"] == 1 and pb.num_sequences == 2
    # The advantages are those of the whole group (mean 0.5, population std ~0.41).
    assert pb.micro_batches[0].advantages.tolist() == pytest.approx([1.2247, -1.2247], abs=1e-3)


def test_impossible_logprobs_are_treated_as_missing_and_counted(caplog):
    g = make_group([1, 2], [[5, 6], [7]], [1.0, 0.0])
    g["inference_logprobs"][0][3] = 1e6  # a completion position: no log-probability is positive
    prompt_only = make_group([1, 2], [[5, 6], [7]], [1.0, 0.0])  # 1.0 at prompt positions is the convention
    with caplog.at_level(logging.WARNING):
        pb = prep([g, prompt_only], warn=WarnOnce())
    assert pb.metrics["data/impossible_logprobs"] == 1 and pb.metrics["data/missing_logprobs"] == 1
    inf = pb.micro_batches[0].inference_logprobs
    assert torch.isnan(inf[0]).all() and not torch.isnan(inf[1:]).any()
    assert pb.num_sequences == 4  # trained, as on-policy
    (message,) = warnings_of(caplog)
    assert "'inference_logprobs'" in message and "1e+06" in message


def test_a_group_of_one_and_equal_scores_have_zero_advantage_counted_and_kept(caplog):
    single = make_group([1], [[5, 6]], [1.0])
    equal = make_group([1], [[5], [6, 7]], [0.5, 0.5])
    sent = make_group([1], [[5, 6]], [1.0], advantages=[0.7])  # one sequence, but the server sent its advantage
    with caplog.at_level(logging.WARNING):
        pb = prep([single, equal, sent, make_group([1], [[5], [6]], [1.0, 0.0])], warn=WarnOnce())
    assert pb.metrics["data/singleton_groups"] == 1
    assert pb.metrics["data/zero_advantage_groups"] == 2  # the single one (no baseline) and the equal one
    # Kept: GRPO trains on them (no policy gradient, but they count in the loss's normalisers).
    assert pb.num_sequences == 6 and pb.metrics["data/dropped_groups"] == 0
    assert pb.micro_batches[0].advantages[:4].tolist() == [0.0, 0.0, 0.0, pytest.approx(0.7)]
    (message,) = warnings_of(caplog)  # zero advantage is normal in GRPO: no warning for it
    assert "one sequence" in message and "'scores'" in message


def test_a_step_with_nothing_trainable_is_skipped_and_counted_not_logged_as_loss_0(tiny_qwen2_dir, tmp_path):
    """The real trainer on the tiny model: rollout batch 2 of 3 holds only groups whose masks are all prompt."""
    from test_ppo_updates import _Groups
    from test_run_history import build_trainer, fit, rows

    class SecondBatchAllPrompt(_Groups):
        def next_groups(self, step):
            groups = super().next_groups(step)
            if step != 1:
                return groups
            for g in groups:
                g.masks = [[-100] * len(m) for m in g.masks]
            return groups

    trainer = build_trainer(tiny_qwen2_dir, tmp_path / "run", steps=3)
    trainer.pipeline = SecondBatchAllPrompt(trainer.tokenizer.pad_token_id, 4)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    fit(trainer)
    first, skipped, third = rows(tmp_path / "run")
    assert [r["step"] for r in (first, skipped, third)] == [1, 2, 3]
    assert skipped["train/skipped_empty"] == 1 and first["train/skipped_empty"] == third["train/skipped_empty"] == 0
    assert skipped["loss"] is None and skipped["grad_norm"] is None and skipped["tokens/trained"] == 0
    assert skipped["data/no_loss_token_groups"] == 2 and skipped["reward/mean"] is None
    assert math.isfinite(first["loss"]) and math.isfinite(third["loss"])
    assert trainer.rewards == [first["reward/mean"], third["reward/mean"]]
    assert trainer.scheduler.last_epoch == 2  # the skipped step did not move the schedule
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    json.dumps(skipped)  # the row is plain JSON (no NaN)


"""train.skip_zero_advantage: leaving the rows whose advantage is 0 everywhere out of the forward passes gives the
same loss and gradients (every aggregation, dual clip, prefix sharing, mini-batches), keeps the optimizer stepping
when every row is zero, and is refused with a KL penalty, which those rows do add to."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError
from grpo.pipeline.batching import prepare_batch
from grpo.pipeline.group import Group
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.minibatch import without_zero_advantage_rows
from test_packing import update_trainer


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _groups(scores: list[list[float]], seed: int = 0) -> list[Group]:
    """One group per score list (equal scores: a zero-advantage group); prompts and completions of varied lengths,
    rollout log-probs away from the trainer's so the clip acts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, group_scores in enumerate(scores):
        prompt = torch.randint(3, 250, (3 + k,), generator=g).tolist()
        comps = [torch.randint(3, 250, (1 + (2 * j + k) % 5,), generator=g).tolist() for j in range(len(group_scores))]
        lps = [[-3.0 - 0.4 * i for i in range(len(c))] for c in comps]
        out.append(Group.sampled(prompt, comps, lps, group_scores, 1.0))
    return out


SCORES = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("aggregation, dual_clip, shared, mini_batches", [
    ("token_mean", None, False, 1), ("token_mean", 3.0, True, 1), ("seq_mean_token_mean", None, True, 2),
    ("seq_mean_token_sum_norm", None, False, 2),
])
def test_leaving_zero_advantage_rows_out_keeps_loss_and_gradients(tiny_qwen2_dir, aggregation, dual_clip, shared,
                                                                  mini_batches):
    model = _model(tiny_qwen2_dir)
    loss_fn = GRPOLoss(aggregation=aggregation, dual_clip=dual_clip, clip_eps=0.1)
    batch = prepare_batch(_groups(SCORES), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    assert batch.metrics["data/zero_advantage_groups"] == 2
    got = {}
    for skip in (False, True):
        trainer = update_trainer(model, loss_fn, prefix_sharing=shared, skip_zero_advantage=skip,
                                 mini_batches=mini_batches)
        # update() in full: the optimizer (SGD at lr 0, the weights stay) steps between the sync's hooks.
        trainer.sync.before_optimizer_step = trainer.sync.after_optimizer_step = lambda: None
        trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
        got[skip] = []
        for _, mini in trainer.plan(batch):
            row = trainer.update(mini)
            got[skip].append((row, _grads(model)))
    for (full, g_full), (trimmed, g_trimmed) in zip(got[False], got[True]):
        assert full["batch/rows_left_out"] == 0 and trimmed["batch/rows_left_out"] > 0
        assert trimmed["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-7)
        assert trimmed["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5, abs=1e-7)
        assert trimmed["tokens/forwarded"] < full["tokens/forwarded"]
        assert trimmed["tokens/trained"] == full["tokens/trained"]
        for name, g in g_full.items():
            torch.testing.assert_close(g_trimmed[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert sum(r["batch/rows_left_out"] for r, _ in got[True]) == 8  # the two equal-score groups, 4 rows each
    # The clip did act on the rows that were kept (the equality is not one of all-zero terms).
    assert max(r["grpo/clipped_fraction"] for r, _ in got[True]) > 0


def test_a_batch_of_only_zero_advantage_rows_still_steps_the_optimizer(tiny_qwen2_dir):
    """AdamW moves on its momentum even at a zero gradient, and a parameter without one would not move: one row is
    forwarded so every parameter gets its (zero) gradient."""
    model = _model(tiny_qwen2_dir)
    batch = prepare_batch(_groups([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), max_seq_len=64, micro_batch_size=3,
                          pad_token_id=0)
    kept = without_zero_advantage_rows(batch, 3)
    left_out = kept.num_sequences - sum(mb.num_sequences for mb in kept.micro_batches)
    assert left_out == 5 and kept.num_sequences == batch.num_sequences and kept.num_loss_tokens == batch.num_loss_tokens
    trainer = update_trainer(model, GRPOLoss(), skip_zero_advantage=True)
    (_, planned), = trainer.plan(batch)
    trainer.forward_backward(planned)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)


def test_a_kl_penalty_refuses_skipping_zero_advantage_rows(tiny_qwen2_dir):
    model = _model(tiny_qwen2_dir)
    with pytest.raises(ConfigError, match="kl_coef"):
        update_trainer(model, GRPOLoss(kl_coef=0.01, kl_reference="rollout"), skip_zero_advantage=True)
    assert update_trainer(model, GRPOLoss(kl_coef=0.0), skip_zero_advantage=True).skip_zero_advantage
    # An entropy bonus acts at every loss token, its advantage 0 or not.
    with pytest.raises(ConfigError, match="entropy_coef=0"):
        update_trainer(model, GRPOLoss(entropy_coef=0.01), skip_zero_advantage=True)

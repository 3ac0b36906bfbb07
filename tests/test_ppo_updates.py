"""Several policy updates per rollout batch (train.ppo_epochs, train.mini_batches, loss.old_logprobs): the default is
one update on the batch as it is; more updates move the policy away from pi_old so the clip acts; recompute gives
ratio 1 at the first update; a run resumed at a batch boundary equals the uninterrupted one. The trainer runs on the
tiny model with fixed groups (no server: the data path is not what these tests are about)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from grpo.pipeline.base import BatchShape, DataPipeline
from grpo.pipeline.batching import prepare_batch
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.group import Group
from grpo.schema import LoggingConfig, TrainConfig
from grpo.sync.base import SyncStrategy
from grpo.trainer.checkpoint import CheckpointManager
from grpo.trainer.loop import GRPOTrainer
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.metrics import MetricsLogger
from grpo.trainer.minibatch import split_mini_batches, update_plan
from grpo.trainer.optim import build_scheduler
from grpo.trainer.train_batch import IGNORE_INDEX


def _groups(seed: int, n_groups: int = 2, group_size: int = 4) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(3, 250, (5,), generator=g).tolist()
        comps = [torch.randint(3, 250, (3 + j,), generator=g).tolist() for j in range(group_size)]
        lps = [[-2.0 - 0.1 * i for i in range(len(c))] for c in comps]
        out.append(Group.sampled(prompt, comps, lps, [float(j % 2) + 0.3 * k for j in range(group_size)], 1.0))
    return out


class _Groups(DataPipeline):
    """Other groups for every rollout batch (seeded by its index), batched as a run would."""

    def __init__(self, pad: int, micro_batch_size: int) -> None:
        self.ctx = SimpleNamespace(batch_shape=BatchShape(micro_batch_size=micro_batch_size, max_seq_len=64,
                                                          pad_token_id=pad))
        self.served: list[int] = []

    def setup(self, ctx):
        pass

    def next_groups(self, step):
        self.step = step
        self.served.append(step)
        return _groups(100 + step)


class _NoServer(SyncStrategy):
    """Counts syncs; serves nothing."""

    def sync(self, model, step):
        self.version += 1
        return {"sync/seconds": 0.0, "sync/version": float(self.version)}


def _trainer(model_dir: Path, run_dir: Path, steps: int, loss: GRPOLoss, start=None, **train) -> GRPOTrainer:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.pop("lr", 1e-2))
    cfg = OmegaConf.structured(TrainConfig(steps=steps, micro_batch_size=2, grad_accum=4, checkpoint_every=2,
                                           **train))
    scheduler = build_scheduler(optimizer, "constant", 0, steps)
    pipeline = _Groups(tok.pad_token_id, cfg.micro_batch_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = CheckpointManager(run_dir, keep=3)
    start_step = start_batch = 0
    state: dict = {}
    if start is not None:
        state = checkpoints.load(start, model, optimizer, scheduler)
        start_step, start_batch = int(state["step"]), state["batch"]
        pipeline.load_state_dict(state["data"])
    metrics = MetricsLogger(run_dir, OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False)), cfg,
                            steps, start_step)
    return GRPOTrainer(train_cfg=cfg, model=model, tokenizer=tok, optimizer=optimizer, scheduler=scheduler,
                       loss_fn=loss, pipeline=pipeline, sync=_NoServer(), checkpoints=checkpoints, metrics=metrics,
                       device=torch.device("cpu"), start_step=start_step, start_batch=start_batch,
                       loss_state=state.get("loss"))


def _rows(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_plan_is_the_rollout_batch_itself_and_draws_no_randomness():
    batch = prepare_batch(_groups(1), max_seq_len=64, micro_batch_size=2, pad_token_id=0)
    state = (random.getstate(), torch.get_rng_state())
    plan = update_plan(batch, ppo_epochs=1, mini_batches=1, seed=0, batch_number=3)
    assert len(plan) == 1 and plan[0][0] == 0 and plan[0][1] is batch
    assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[1])


def test_mini_batches_partition_the_batch_and_keep_every_value():
    batch = prepare_batch(_groups(2, n_groups=3), max_seq_len=64, micro_batch_size=4, pad_token_id=0)
    minis = split_mini_batches(batch, 3, micro_batch_size=3, rng=random.Random(0))
    assert [m.num_sequences for m in minis] == [4, 4, 4]
    assert sum(m.num_loss_tokens for m in minis) == batch.num_loss_tokens
    assert all(m.max_completion_tokens == batch.max_completion_tokens for m in minis)

    def rows(b):  # each sequence's trained (label, rollout log-prob, advantage) triples, padding stripped
        out = []
        for mb in b.micro_batches:
            for r in range(mb.num_sequences):
                keep = mb.labels[r] != IGNORE_INDEX
                out.append((tuple(mb.labels[r][keep].tolist()), tuple(mb.inference_logprobs[r][keep].tolist()),
                            float(mb.advantages[r])))
        return sorted(out)

    assert sorted(sum((rows(m) for m in minis), [])) == rows(batch)
    again = split_mini_batches(batch, 3, micro_batch_size=3, rng=random.Random(0))
    assert [rows(m) for m in again] == [rows(m) for m in minis]  # the run's seed decides the shuffle
    other = split_mini_batches(batch, 3, micro_batch_size=3, rng=random.Random(1))
    assert [rows(m) for m in other] != [rows(m) for m in minis]


def test_recompute_gives_ratio_one_at_the_first_update_and_the_second_pass_moves(tiny_qwen2_dir, tmp_path):
    trainer = _trainer(tiny_qwen2_dir, tmp_path / "run", steps=2, loss=GRPOLoss(clip_eps=0.01, old_logprobs="recompute"),
                       ppo_epochs=2)
    trainer.fit()
    trainer.metrics.close()
    first, second = _rows(tmp_path / "run")
    assert (first["batch"], first["epoch"], second["batch"], second["epoch"]) == (1, 0, 1, 1)
    # pi_old is the same weights' log-prob: the ratio is 1 up to float32 rounding (the no-grad recompute and the
    # update's forward may take CPU kernels that differ in the last bit: 0.99999994 on an AMD EPYC), so the clip
    # (0.01 here) never binds at the first update.
    assert first["grpo/ratio_old_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["grpo/ratio_old_max"] == pytest.approx(1.0, abs=1e-6)
    assert first["grpo/approx_kl_old"] < 1e-12 and first["grpo/clipped_fraction"] == 0.0
    assert second["grpo/ratio_old_mean"] != 1.0 and second["grpo/approx_kl_old"] > 0
    assert second["grpo/clipped_fraction"] > 0
    assert second["grpo/clipped_low"] + second["grpo/clipped_high"] == pytest.approx(second["grpo/clipped_fraction"])
    # The batch's data metrics sit on its first update, the sync on its last.
    assert "reward/mean" in first and "reward/mean" not in second
    assert first["sync/seconds"] == 0.0 and second["sync/version"] == 1.0
    # Per rollout batch, on its last row: the updates it got and how the clip and pi_old moved over them.
    assert second["batch/updates"] == 2 and "batch/updates" not in first
    assert second["batch/clipped_fraction_mean"] == pytest.approx((first["grpo/clipped_fraction"]
                                                                   + second["grpo/clipped_fraction"]) / 2)
    assert second["batch/approx_kl_old_max"] == max(first["grpo/approx_kl_old"], second["grpo/approx_kl_old"])


def test_two_clip_eps_give_different_losses_once_the_policy_moved(tiny_qwen2_dir, tmp_path):
    losses = {}
    for eps in (0.05, 0.3):
        trainer = _trainer(tiny_qwen2_dir, tmp_path / f"eps{eps}", steps=4,
                           loss=GRPOLoss(clip_eps=eps, old_logprobs="recompute"), ppo_epochs=2, mini_batches=2)
        trainer.fit()
        trainer.metrics.close()
        losses[eps] = [r["loss"] for r in _rows(tmp_path / f"eps{eps}")]
    assert losses[0.05][0] == losses[0.3][0]  # nothing to clip before the policy moves
    assert losses[0.05][1:] != losses[0.3][1:]


def test_resume_at_a_batch_boundary_equals_the_uninterrupted_run(tiny_qwen2_dir, tmp_path):
    loss = GRPOLoss(clip_eps=0.2, old_logprobs="recompute")
    full = _trainer(tiny_qwen2_dir, tmp_path / "full", steps=8, loss=loss, ppo_epochs=2, mini_batches=2)
    full.fit()
    full.metrics.close()
    part = _trainer(tiny_qwen2_dir, tmp_path / "part", steps=4, loss=loss, ppo_epochs=2, mini_batches=2)
    part.fit()
    part.metrics.close()
    ckpt = CheckpointManager(tmp_path / "part").latest()
    resumed = _trainer(tiny_qwen2_dir, tmp_path / "part", steps=8, loss=loss, start=ckpt, ppo_epochs=2, mini_batches=2)
    assert (resumed.step, resumed.batch_number) == (4, 1)
    resumed.fit()
    resumed.metrics.close()
    assert resumed.pipeline.served == [1]  # rollout batch 1 again, nothing skipped or repeated
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "part")
    assert [r["step"] for r in b] == list(range(1, 9))
    for key in ("loss", "grad_norm", "grpo/ratio_old_mean", "batch", "epoch"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_resume_goes_on_from_the_entropy_coefficient_the_run_had_adapted_to(tiny_qwen2_dir, tmp_path):
    """loss.entropy_target: the coefficient moves after every optimizer step (here up: the target is above any
    entropy the tiny model has), the row logs the one its step used, and a checkpoint keeps it, so 2 + 2 steps with a
    resume (a fresh loss object, as a new process builds) equal 4 straight."""
    def loss():
        return GRPOLoss(entropy_coef=0.01, entropy_target=100.0, entropy_coef_delta=0.02)

    full = _trainer(tiny_qwen2_dir, tmp_path / "full", steps=4, loss=loss())
    full.fit()
    full.metrics.close()
    part = _trainer(tiny_qwen2_dir, tmp_path / "part", steps=2, loss=loss())
    part.fit()
    part.metrics.close()
    resumed_loss = loss()
    resumed = _trainer(tiny_qwen2_dir, tmp_path / "part", steps=4, loss=resumed_loss,
                       start=CheckpointManager(tmp_path / "part").latest())
    assert resumed_loss.entropy.coef == pytest.approx(0.05)  # 0.01 + 2 x 0.02, from the checkpoint
    resumed.fit()
    resumed.metrics.close()
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "part")
    assert [r["grpo/entropy_coef"] for r in a] == pytest.approx([0.01, 0.03, 0.05, 0.07])
    for key in ("loss", "grad_norm", "grpo/entropy", "grpo/entropy_coef"):
        assert [r[key] for r in a] == [r[key] for r in b], key


@pytest.mark.parametrize("name, loss", [
    ("gspo", lambda: GRPOLoss(objective="gspo", clip_eps=3e-4, clip_eps_high=4e-4, aggregation="seq_mean_token_mean",
                              old_logprobs="recompute")),
    ("cispo", lambda: GRPOLoss(objective="cispo", clip_eps=1.0, clip_eps_high=0.28, old_logprobs="recompute")),
    # The scripted rollout log-probs lie ~3.3 nats above the tiny model's (ratio ~0.04): bands around that.
    ("masks", lambda: GRPOLoss(token_mask=[0.04, 25.0], sequence_mask=[0.035, 30.0])),
])
def test_issue_40_losses_compose_with_several_updates_fused_unfused_and_packed(tiny_qwen2_dir, tmp_path, name, loss):
    """GSPO, CISPO and the off-policy masks under 2 epochs x 2 mini-batches: the fused path (two passes where the loss
    is not token-separable), the unfused one and padding-free packing train the same losses; the mismatch metrics
    ride on every row."""
    runs = {}
    for layout, train in {"fused": {}, "unfused": {"fused_loss": False}, "packed": {"padding_free": True}}.items():
        trainer = _trainer(tiny_qwen2_dir, tmp_path / layout, steps=4, loss=loss(), ppo_epochs=2, mini_batches=2,
                           **train)
        trainer.fit()
        trainer.metrics.close()
        runs[layout] = _rows(tmp_path / layout)
    rows = runs["fused"]
    assert len(rows) == 4 and all(r["loss"] is not None for r in rows)
    assert all("mismatch/kl" in r and "mismatch/masked_fraction" in r for r in rows)
    for layout in ("unfused", "packed"):
        assert [r["loss"] for r in runs[layout]] == pytest.approx([r["loss"] for r in rows], rel=1e-3, abs=1e-6)
    if name == "gspo":  # the policy moved after the first update: the narrow sequence clip binds
        assert max(r["grpo/clipped_fraction"] for r in rows[1:]) > 0
    if name == "masks":  # the masks drop some tokens and train the others
        assert 0 < rows[0]["mismatch/masked_fraction"] < 1 and rows[0]["mismatch/kl"] > 0 and rows[0]["loss"] != 0


def test_evaluations_fall_on_a_regular_grid_of_rollout_batches(tiny_qwen2_dir, tmp_path, caplog):
    """Several updates per rollout batch: evaluations ran after the batches that reached each multiple of
    eval.every (sweep=clip_eps, 4 updates, every 10: steps 12, 20, 32, 40, ...). eval.every is rounded up to a
    multiple of the updates per batch now (here 2 updates, every 3: steps 4 and 8, not 4, 6 and 8), said in the log."""
    import logging

    from transformers import AutoTokenizer

    from grpo.pipeline.evaluation import EvalContext, Evaluator
    from grpo.tasks.prompts import DigitsTask
    from grpo.tasks.rewards import DigitFractionReward

    class Recorded(Evaluator):
        """The real evaluator's schedule; its sampling left out (no server here)."""

        def evaluate(self, step):
            self.steps.append(step)
            return {}

    trainer = _trainer(tiny_qwen2_dir, tmp_path / "run", steps=8, loss=GRPOLoss(old_logprobs="recompute"),
                       ppo_epochs=2)
    evaluator = Recorded(task=DigitsTask(eval_size=4), rewards={"digits": DigitFractionReward()}, every=3)
    evaluator.steps = []
    with caplog.at_level(logging.INFO, logger="grpo.pipeline.evaluation"):
        evaluator.setup(EvalContext(tokenizer=AutoTokenizer.from_pretrained(tiny_qwen2_dir),
                                    generation=GenerationHandle(lambda: None),
                                    run_dir=tmp_path, seed=0, total_steps=8, max_seq_len=64, updates_per_batch=2))
    assert "eval: every 4 steps (eval.every=3 rounded up to a multiple of the 2 updates per rollout batch" in caplog.text
    assert Evaluator.batch_grid(10, 4) == 12 and Evaluator.batch_grid(10, 1) == 10 and Evaluator.batch_grid(0, 4) == 0
    trainer.evaluations.evaluator = evaluator
    trainer.fit()
    trainer.metrics.close()
    assert evaluator.steps == [0, 4, 8]

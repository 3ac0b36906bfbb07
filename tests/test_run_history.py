"""Issue 21 items 2 and 3: every step whose weights are in a checkpoint has its metrics row on disk (SIGTERM inside
the checkpoint write, delivered through the fault hooks; a checkpoint directory that cannot be written), and a
resumed run's history is one series (each step once; in the resumed run dir by default, carried over into another).

The real trainer loop, checkpoints and metrics logger on the tiny model with fixed groups and no server (as in
tests/test_ppo_updates.py): the data path is not what these tests are about, and no vLLM start is needed."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo.conf import CONFIG_DIR
from grpo.schema import LoggingConfig, TrainConfig
from grpo.trainer.checkpoint import CheckpointManager, CheckpointWriteError
from grpo.trainer.loop import GRPOTrainer
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.metrics import MetricsLogger
from grpo.trainer.optim import build_scheduler
from test_ppo_updates import _Groups, _NoServer


def build_trainer(model_dir: Path, run_dir: Path, steps: int, resume: Path | None = None) -> GRPOTrainer:
    """A trainer checkpointing every 2 steps; with `resume` (a run dir), from that run's latest checkpoint, its
    metrics history carried into `run_dir` as train.py does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = OmegaConf.structured(TrainConfig(steps=steps, micro_batch_size=4, grad_accum=2, checkpoint_every=2))
    scheduler = build_scheduler(optimizer, "constant", 0, steps)
    pipeline = _Groups(tok.pad_token_id, cfg.micro_batch_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    start_step = start_batch = 0
    if resume is not None:
        state = CheckpointManager(resume).load(CheckpointManager(resume).latest(), model, optimizer, scheduler)
        start_step, start_batch = int(state["step"]), state["batch"]
        pipeline.load_state_dict(state["data"])
    metrics = MetricsLogger(run_dir, OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False)), cfg,
                            steps, start_step, resumed_from=resume)
    return GRPOTrainer(train_cfg=cfg, model=model, tokenizer=tok, optimizer=optimizer, scheduler=scheduler,
                       loss_fn=GRPOLoss(clip_eps=0.2), pipeline=pipeline, sync=_NoServer(),
                       checkpoints=CheckpointManager(run_dir, keep=5), metrics=metrics, device=torch.device("cpu"),
                       start_step=start_step, start_batch=start_batch)


def fit(trainer: GRPOTrainer) -> None:
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in rows(run_dir)]


def latest_step(run_dir: Path) -> int:
    latest = CheckpointManager(run_dir).latest()
    return json.loads((latest / "trainer_state.json").read_text())["step"]


@pytest.fixture
def sigterm_as_interrupt():
    """train.py's SIGTERM handler (a clean stop through KeyboardInterrupt), for the duration of a test."""
    def interrupt(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("phase, checkpoint_left", [("checkpoint_write", 2), ("checkpoint_published", 4)])
def test_sigterm_inside_the_checkpoint_write_keeps_the_row_and_resume_logs_each_step_once(
        tiny_qwen2_dir, tmp_path, monkeypatch, sigterm_as_interrupt, phase, checkpoint_left):
    run = tmp_path / "run"
    monkeypatch.setenv("GRPO_FAULT", f"sigterm@{phase}:4")
    with pytest.raises(KeyboardInterrupt):
        fit(build_trainer(tiny_qwen2_dir, run, steps=6))
    monkeypatch.delenv("GRPO_FAULT")
    # checkpoint_write: step 4's checkpoint is discarded; checkpoint_published (the issue's case): it is complete.
    # Either way step 4 was trained and its row is on disk.
    assert latest_step(run) == checkpoint_left
    assert steps(run) == [1, 2, 3, 4]
    interrupted = rows(run)

    fit(build_trainer(tiny_qwen2_dir, run, steps=6, resume=run))
    assert steps(run) == [1, 2, 3, 4, 5, 6]
    # The rows up to the checkpoint are the interrupted run's; the steps after it are the resumed run's own.
    assert rows(run)[:checkpoint_left] == interrupted[:checkpoint_left]
    assert [r["loss"] for r in rows(run)[:4]] == pytest.approx([r["loss"] for r in interrupted])


def test_an_unwritable_checkpoint_dir_fails_the_run_with_the_rows_on_disk(tiny_qwen2_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # A file where checkpoints/ belongs: nothing can be written under it, even by root (these tests run as root,
    # which mode bits do not stop).
    (run / "checkpoints").write_text("")
    with pytest.raises(CheckpointWriteError, match=f"could not write checkpoint step 2 under {run / 'checkpoints'}"):
        fit(build_trainer(tiny_qwen2_dir, run, steps=4))
    assert steps(run) == [1, 2]
    assert all(r["loss"] is not None for r in rows(run))


def test_resume_into_another_run_dir_carries_the_history_trimmed_at_the_checkpoint(tiny_qwen2_dir, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    fit(build_trainer(tiny_qwen2_dir, first, steps=4))
    shutil.rmtree(first / "checkpoints" / "step_000004")  # as if the run had died writing step 4's checkpoint
    earlier = rows(first)  # steps 1-4; the latest checkpoint is step 2

    fit(build_trainer(tiny_qwen2_dir, second, steps=6, resume=first))
    assert steps(second) == [1, 2, 3, 4, 5, 6]
    assert rows(second)[:2] == earlier[:2]
    assert rows(first) == earlier  # the resumed run dir is left as it was

    from grpo.report import report
    from grpo.trainer.metrics import plot_curves

    _, (job,) = report(second)  # a single run dir is its own one-job report
    assert job["steps"] == 6 and [s for s, _ in job["_rewards"]] == [1, 2, 3, 4, 5, 6]
    assert plot_curves(second / "metrics.jsonl", second / "curves.png").stat().st_size > 0


def test_train_resume_continues_in_the_resumed_run_dir_unless_another_is_named():
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from grpo.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for overrides, expected in ((["train.resume=/runs/a"], "/runs/a"),
                                    (["train.resume=/runs/a", "hydra.run.dir=/runs/b"], "/runs/b")):
            cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            assert cfg.hydra.run.dir == expected
        cfg = compose(config_name="train", return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        assert os.path.dirname(cfg.hydra.run.dir).startswith("outputs/")  # a fresh run: a new dir under outputs/

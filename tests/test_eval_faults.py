"""The in-run evaluation when the inference server dies under it: the server is restarted like a crash during
generation (bounded by server.max_restarts) and the evaluation runs again; when it cannot be, the steps already
trained keep their rows."""

from __future__ import annotations

import json

import pytest

from conftest import free_port
from test_reliability import assert_valid_checkpoint, server_starts, train
from test_run_history import build_trainer, fit, rows
from test_train_e2e import assert_clean


@pytest.mark.slow  # 40-105 s of the CI suite's 25-minute budget: run with `pytest -m slow`
@pytest.mark.vllm
def test_a_server_killed_during_an_in_run_eval_is_restarted_and_the_eval_row_written_once(tmp_path, tiny_qwen2_dir):
    """Before: the eval's ServerUnreachable ended the run (no restart, though one was allowed), and step 2, trained,
    had no row. ~40 s: one vLLM start and one restart."""
    run = tmp_path / "run"
    code, out, marker = train("eval=default", "eval.every=2", "eval.samples_per_prompt=2", "eval.k=1",
                              "train.steps=3", "train.checkpoint_every=1", "server.max_restarts=1",
                              f"server.port={free_port()}", f"hydra.run.dir={run}", fault="kill_server_evaluating@2")
    assert code == 0, out[-3000:]
    assert "GRPO_FAULT: kill_server_evaluating" in out and "restart 1 of 1 on weight version 2" in out, out[-3000:]
    table = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in table if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    # Evals before training, after step 2 (on the restarted server, which serves step 2's weights) and at the end,
    # beside training: each in a row of its own, once.
    evaluated = [r for r in table if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 3]
    assert evaluated[1]["eval/weight_version"] == 2
    # The eval of step 2 killed the server; the health check before step 3 restarted it (counted from its row on).
    assert [r.get("server/restarts") for r in trained] == [0, 0, 1]
    samples = [json.loads(line)["step"] for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == [0, 2, 3] and samples.count(2) == samples.count(0)  # the eval of step 2 once
    assert server_starts(run)[1] == str(run / "served_weights" / "v2")
    assert_valid_checkpoint(run, 3, tiny_qwen2_dir)
    assert_clean(marker)


@pytest.mark.parametrize("error", [RuntimeError("inference server exited; giving up after 0 restarts"),
                                   KeyboardInterrupt("signal 15")], ids=["no_restart_left", "sigterm"])
def test_an_eval_that_fails_after_training_steps_leaves_their_rows(tiny_qwen2_dir, tmp_path, error):
    """The trainer loop, no server (an evaluator that fails after step 2, as one with no restart left does, or is
    stopped by SIGTERM, which train.py raises as KeyboardInterrupt): the rows of steps 1-2 are on disk before the
    error, so the stop block names step 2 as the last one done (step 2's checkpoint, due after its eval, is not
    written: a resume trains step 2 again and replaces its row)."""
    from grpo.stop import last_step

    class FailingEval:
        def due(self, step, total):
            return step == 2

        def evaluate(self, step):
            raise error

    run = tmp_path / "run"
    trainer = build_trainer(tiny_qwen2_dir, run, steps=4)
    trainer.evaluations.evaluator = FailingEval()
    with pytest.raises(type(error)):
        fit(trainer)
    assert last_step(run) == 2
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert all(r["loss"] is not None and "eval/accuracy" not in r for r in rows(run))

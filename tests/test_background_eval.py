"""Evaluations beside training (eval.background, grpo.trainer.background_eval) in the real trainer loop, without a
server: an evaluation's requests never see the weights change under them (the loop waits for them before the next
sync, or under shared_vllm before the next optimizer step), the loop never waits for their scoring except at the
end, and a resume evaluates its checkpoint's step when the stopped run had not written that evaluation's row.

The evaluator here stands in for the server's answers (it sleeps where requests and grading take time, and reads
the weight version the sync strategy says is served): what is tested is the loop's schedule, not the evaluator
(tests/test_evaluation.py runs the real one beside real training)."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from grpo.trainer.background_eval import BackgroundEvaluations
from test_ppo_updates import _NoServer
from test_run_history import build_trainer, fit, rows


class _InPlaceServer(_NoServer):
    """A sync strategy whose optimizer steps change the served weights (as shared_vllm's do)."""

    serves_weights_in_place = True

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0

    def before_optimizer_step(self) -> None:
        self.changes += 1


class _Watched(BackgroundEvaluations):
    """Says when the loop starts waiting for an evaluation's requests (`settling`)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.settling = threading.Event()

    def settle(self) -> None:
        self.settling.set()
        super().settle()


class _SlowEval:
    """Requests that last until the loop waits for them (or the served weights change under them, or `generate_s`
    at most), so a loop that does not wait changes the weights under them; grading that takes `score_s`. Records
    which weights were served when its requests began and ended."""

    background = True

    def __init__(self, served, due_steps, generate_s: float = 30.0, score_s: float = 1.5) -> None:
        self.served, self.due_steps, self.generate_s, self.score_s = served, set(due_steps), generate_s, score_s
        self.evals: _Watched | None = None

    def due(self, step, total_steps):  # noqa: ARG002
        return step in self.due_steps

    def generate(self, step):
        self.evals.settling.clear()
        t0, begin = time.monotonic(), self.served()
        while (time.monotonic() < t0 + self.generate_s and not self.evals.settling.is_set()
               and self.served() == begin):
            time.sleep(0.01)
        return step, begin, self.served(), time.monotonic() - t0

    def score(self, generated):
        time.sleep(self.score_s)
        _, begin, end, seconds = generated
        return {"eval/accuracy": 0.5, "eval/served_at_start": float(begin), "eval/served_at_end": float(end),
                "eval/generation_seconds": seconds}

    def evaluate(self, step):
        return self.score(self.generate(step))


def _beside(trainer, evaluator) -> None:
    trainer.evaluations.evaluator = evaluator
    trainer.evaluations.background = evaluator.evals = _Watched(evaluator, trainer.sync.server.recover)


@pytest.mark.parametrize("in_place", [False, True], ids=["weights_change_at_sync", "weights_change_at_optimizer_step"])
def test_an_eval_beside_training_sees_one_set_of_weights_and_the_loop_waits_only_at_the_end(tmp_path, tiny_qwen2_dir,
                                                                                          in_place):
    run = tmp_path / "run"
    trainer = build_trainer(tiny_qwen2_dir, run, steps=4)
    if in_place:
        trainer.sync = _InPlaceServer()
        served = lambda: trainer.sync.changes  # noqa: E731
    else:
        served = lambda: trainer.sync.version  # noqa: E731
    _beside(trainer, _SlowEval(served, {0, 2, 4}))
    fit(trainer)
    table = rows(run)
    assert [r["step"] for r in table if "loss" in r] == [1, 2, 3, 4]
    evaluated = [r for r in table if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 4] and table[-1] is evaluated[-1]  # the last one completes first
    for r in evaluated:  # no weight change while its requests ran
        assert r["eval/served_at_start"] == r["eval/served_at_end"], r
    # The scoring (1.5 s each) of the evaluations of steps 0 and 2 ran beside training: the loop waited at most for
    # their requests. The last one it waited for at the end (beside the last checkpoint's write).
    waited = sum(r["time/eval_wait_seconds"] for r in table if "loss" in r)
    assert waited < evaluated[0]["eval/generation_seconds"] + evaluated[1]["eval/generation_seconds"] + 1.0, waited
    assert trainer.clock.parts["eval_wait"] == pytest.approx(waited + evaluated[-1]["time/eval_wait_seconds"])


def test_a_resume_evaluates_its_checkpoint_step_when_the_stopped_run_had_not_written_that_row(tmp_path,
                                                                                            tiny_qwen2_dir):
    """The evaluation of a checkpoint's own step may still run beside training when the run stops (its row not yet
    written); the resumed run, which starts from that step's weights, evaluates it first. Once: a row that was
    written is not evaluated again."""
    run = tmp_path / "run"
    trainer = build_trainer(tiny_qwen2_dir, run, steps=4)
    _beside(trainer, _SlowEval(lambda: trainer.sync.version, {2, 4}, 0.0, 0.0))
    fit(trainer)
    # As if stopped after the checkpoint of step 2, before the evaluation of step 2 wrote its row.
    shutil.rmtree(run / "checkpoints" / "step_000004")
    kept = [line for line in (run / "metrics.jsonl").read_text().splitlines()
            if not ('"eval/accuracy"' in line and '"step": 2,' in line)]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")

    def resume() -> list[dict]:
        again = build_trainer(tiny_qwen2_dir, run, steps=4, resume=run)
        _beside(again, _SlowEval(lambda: again.sync.version, {2, 4}, 0.0, 0.0))
        fit(again)
        return rows(run)

    table = resume()
    assert [r["step"] for r in table if "loss" in r] == [1, 2, 3, 4]
    assert sorted(r["step"] for r in table if "eval/accuracy" in r) == [2, 4]
    # Resumed again from step 2 with its evaluation's row there: not evaluated twice.
    shutil.rmtree(run / "checkpoints" / "step_000004")
    table = resume()
    assert sorted(r["step"] for r in table if "eval/accuracy" in r) == [2, 4]

"""The loop's held-out evaluations (rank 0 only; none without an evaluator): when they run (after a rollout batch's
sync, so each samples the weights of the step it is labelled with; blocking, or beside training with eval.background:
`grpo.trainer.background_eval`), the rows they add, and the seconds the loop waited on them (time/eval_wait_seconds,
the wall clock's eval_wait)."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol

from grpo.trainer.background_eval import BackgroundEvaluations, PhasedEvaluator
from grpo.trainer.recovery import retried_after_recovery
from grpo.trainer.wall_clock import WallClock


class StepEvaluator(PhasedEvaluator, Protocol):
    """What the loop needs of an evaluator (grpo.pipeline.evaluation.Evaluator; typed here so the trainer does not
    import the pipeline). `background`: its evaluations run beside training (grpo.trainer.background_eval)."""

    background: bool

    def due(self, step: int, total_steps: int) -> bool: ...

    def evaluate(self, step: int) -> dict[str, float]: ...


class LoopEvaluations:
    """The evaluations of one training session: started by the loop when due, their rows, the waits they cost.
    `background`: the evaluations beside training (None when they block)."""

    def __init__(self, evaluator: Optional[StepEvaluator], recover: Callable[[BaseException], bool],
                 clock: WallClock) -> None:
        self.evaluator = evaluator
        self.background = (BackgroundEvaluations(evaluator, recover)
                           if evaluator is not None and getattr(evaluator, "background", False) else None)
        # The sync strategy's recover: restarts a server that died during a blocking evaluation (then run again once).
        self.recover = recover
        self.clock = clock
        # Seconds the loop waited on evaluations not yet reported in a row (time/eval_wait_seconds).
        self.wait_unreported = 0.0

    def due_after(self, first: int, last: int, total_steps: int) -> bool:
        """Whether an evaluation is due at a step after `first` up to `last` (the steps of a rollout batch)."""
        return self.evaluator is not None and any(self.evaluator.due(s, total_steps) for s in range(first + 1, last + 1))

    def at_start(self, step: int, total_steps: int, logged: Callable[[int, str], bool]) -> Optional[dict[str, Any]]:
        """The evaluation of the weights the session starts from: step 0's before training (eval.before_train), or
        a resumed run's checkpoint step when it is due and its row is missing (`logged`: an evaluation beside
        training still running when the run stopped). The row to log when it ran blocking, else None."""
        if self.evaluator is None or not self.evaluator.due(step, total_steps) or step >= total_steps:
            return None
        if step > 0 and logged(step, "eval/"):
            return None
        if self.background is not None:
            self.background.submit(step)
            return None
        row: dict[str, Any] = {"step": step}
        self.start(step, row)
        return {**row, "time/eval_wait_seconds": self.take_wait()}

    def start(self, step: int, row: dict[str, Any]) -> None:
        """The evaluation of `step`, whose weights the server serves now: beside training (its row comes when it
        completes), or blocking, its metrics added to `row`."""
        if self.background is not None:
            self.background.submit(step)
            return
        t0 = time.perf_counter()
        try:
            row.update(self.evaluate(step))
        finally:
            self.note_wait(time.perf_counter() - t0)

    def evaluate(self, step: int) -> dict[str, Any]:
        """The evaluator's metrics after `step`. A server that died during the evaluation is restarted by the sync
        strategy, as for generation (bounded by server.max_restarts), and the evaluation runs again once; its
        samples are written only by the run that completes."""
        evaluator = self.evaluator
        assert evaluator is not None
        return retried_after_recovery(lambda: evaluator.evaluate(step), self.recover)

    def rows(self, results: list[tuple[int, dict[str, float]]], last: bool = False) -> list[dict[str, Any]]:
        """The rows of evaluations run beside training, each with its own step (after that step's training row,
        possibly after later steps' rows); the last one of the run carries the final wait."""
        out = []
        for i, (step, metrics) in enumerate(results):
            row: dict[str, Any] = {"step": step, **metrics}
            if last and i == len(results) - 1:
                row["time/eval_wait_seconds"] = self.take_wait()
            out.append(row)
        return out

    def settle(self) -> None:
        """Before the served weights change: wait until an evaluation beside training has generated."""
        if self.background is not None:
            self.background.settle()

    def note_wait(self, seconds: float) -> None:
        """A blocking evaluation's seconds (those beside training are counted by `BackgroundEvaluations`)."""
        self.wait_unreported += seconds

    def waited_total(self) -> float:
        """Seconds this session's loop waited on evaluations beside training so far."""
        return self.background.waited_total if self.background is not None else 0.0

    def take_wait(self) -> float:
        """Seconds the loop waited on evaluations since the last call (time/eval_wait_seconds), also added to the
        wall clock's eval_wait."""
        if self.background is not None:
            self.wait_unreported += self.background.take_waited()
        waited, self.wait_unreported = self.wait_unreported, 0.0
        self.clock.add("eval_wait", waited)
        return waited

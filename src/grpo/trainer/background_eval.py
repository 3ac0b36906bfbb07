"""Held-out evaluations beside training (`eval.background`): the run waits for an evaluation's generation only
before the served weights next change, and for its scoring only at a checkpoint (the evaluations of earlier steps)
and at the end.

An evaluation has two phases (grpo.pipeline.evaluation.Evaluator): `generate(step)` samples the server, whose weights
must stay those of `step` until it has finished; `score(generated)` grades, computes the metrics and writes the
samples, on nothing but its inputs. `submit(step)` starts both on a thread of their own right after the sync that
put `step`'s weights on the server; the trainer calls `settle()` right before the weights change again (the next
sync; under shared_vllm, whose optimizer step writes the served weights in place, the next optimizer step), which
waits for the generation only. Scorings run one after another, in submission order, so the rows and samples of
evaluations are written in step order.

A generation that failed because the server died (its requests unanswered) is retried by `settle()` on the trainer's
thread once the sync strategy restarted the server (`recover`, bounded by server.max_restarts), as a blocking
evaluation is: the weights have not changed yet, so the retry samples the same ones. Threads are daemons: a run that
stops never waits for an evaluation in flight (its server stops next, which ends the requests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

log = logging.getLogger(__name__)


class PhasedEvaluator(Protocol):
    """The two phases of an evaluation (grpo.pipeline.evaluation.Evaluator; typed here so the trainer does not
    import the pipeline)."""

    def generate(self, step: int) -> Any: ...

    def score(self, generated: Any) -> dict[str, float]: ...


@dataclass
class _Evaluation:
    step: int
    generated: Future = field(default_factory=Future)  # None when done; the generation's error otherwise
    scored: Future = field(default_factory=Future)  # the metrics


def _thread(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()


class BackgroundEvaluations:
    """The evaluations of a run in flight beside training; see the module docstring. Used from the trainer's thread
    only (its own threads touch only their evaluation's futures). `waited_s`: seconds the trainer waited on them."""

    def __init__(self, evaluator: PhasedEvaluator, recover: Callable[[BaseException], bool]) -> None:
        self.evaluator = evaluator
        # The sync strategy's recover: True when it restarted a server that had died, so the generation is retried.
        self.recover = recover
        self._generating: Optional[_Evaluation] = None
        self._scoring: deque[_Evaluation] = deque()
        self.waited_s = 0.0
        # Seconds waited in all (waited_s is reset by take_waited).
        self.waited_total = 0.0

    @property
    def pending(self) -> int:
        """Evaluations submitted whose metrics have not been taken yet."""
        return len(self._scoring) + (self._generating is not None)

    def submit(self, step: int) -> None:
        """Start the evaluation of `step` (the server serves its weights now): generation, then scoring."""
        self.settle()  # normally done already: the weights changed since the previous one was submitted
        evaluation, previous = _Evaluation(step), (self._scoring[-1] if self._scoring else None)

        def run() -> None:
            try:
                generated = self.evaluator.generate(step)
            except BaseException as error:  # settle() retries it or raises it on the trainer's thread
                evaluation.generated.set_exception(error)
                return
            evaluation.generated.set_result(None)
            self._score(evaluation, generated, previous)

        self._generating = evaluation
        _thread(run, f"eval-step-{step}")

    def _score(self, evaluation: _Evaluation, generated: Any, previous: Optional[_Evaluation]) -> None:
        if previous is not None:  # in submission order: rows and samples are written in step order
            try:
                previous.scored.exception()
            except BaseException:  # noqa: BLE001 (its own error is raised where its metrics are taken)
                pass
        try:
            evaluation.scored.set_result(self.evaluator.score(generated))
        except BaseException as error:
            evaluation.scored.set_exception(error)

    def settle(self) -> None:
        """Wait until the evaluation in flight no longer needs the served weights (its generation finished); call it
        before they change. A generation the server's death interrupted runs again here once the server was
        restarted; any other error is raised."""
        evaluation, self._generating = self._generating, None
        if evaluation is None:
            return
        t0 = time.perf_counter()
        try:
            error = evaluation.generated.exception()
            if error is not None:
                if not self.recover(error):
                    raise error
                log.warning("the evaluation of step %d failed (%s); the server was restarted, evaluating again",
                            evaluation.step, error)
                generated = self.evaluator.generate(evaluation.step)
                previous = self._scoring[-1] if self._scoring else None
                _thread(lambda: self._score(evaluation, generated, previous), f"eval-score-{evaluation.step}")
            self._scoring.append(evaluation)
        finally:
            self._waited(time.perf_counter() - t0)

    def _waited(self, seconds: float) -> None:
        self.waited_s += seconds
        self.waited_total += seconds

    def finished(self) -> list[tuple[int, dict[str, float]]]:
        """(step, metrics) of the evaluations scored since the last call, in step order, without waiting."""
        out = []
        while self._scoring and self._scoring[0].scored.done():
            evaluation = self._scoring.popleft()
            out.append((evaluation.step, evaluation.scored.result()))
        return out

    def wait(self, before: Optional[int] = None) -> list[tuple[int, dict[str, float]]]:
        """Wait for every evaluation (`before`: of the steps before it only: a checkpoint waits for those, whose weights
        it no longer holds), settling the one generating; their (step, metrics) in step order."""
        if self._generating is not None and (before is None or self._generating.step < before):
            self.settle()  # times itself
        t0 = time.perf_counter()
        try:
            out = []
            while self._scoring and (before is None or self._scoring[0].step < before):
                evaluation = self._scoring.popleft()
                out.append((evaluation.step, evaluation.scored.result()))
            return out
        finally:
            self._waited(time.perf_counter() - t0)

    def take_waited(self) -> float:
        """Seconds the trainer waited on evaluations since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

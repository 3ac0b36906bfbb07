"""Reward grading of a batch of completions: each distinct (prompt, text) pair graded once, in this process or in a
pool of worker processes (`data.reward_workers`).

Why processes: math-verify (sympy) is pure Python. Graded on the thread that produced the batch, it held the GIL
against the trainer's thread under asynchronous rollouts, and it was a quarter of a step of the real model on one
H100 (bench/gpu/README.md, "Grading in worker processes on the GPU"). Workers are spawned, not forked (the parent
holds CUDA and torch state), once per pipeline or evaluator; each builds the same rewards from their config and grades
on its main thread, where math-verify's SIGALRM timeouts hold. A reward that raises, or a worker that dies, fails
the batch with a RewardError naming the reward: a completion never silently scores 0.

Deduplication assumes what the rewards' contract says: a reward is a function of (prompt, text). A converged policy
writes the same completion many times per group; those are graded once and their values copied.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Callable, Mapping, Optional, Sequence

from grpo.tasks.prompts import Prompt

Pair = tuple[Prompt, str]
# A graded pair as it comes back from grade_pair: each reward's value, and whether the rewards parse the text (None
# when not asked).
RawGrade = tuple[dict[str, float], Optional[bool]]

# Chunks per worker of one batch (more than one evens out texts that take longer, e.g. prose), and the fewest pairs
# in a chunk (below it the pickling round trip costs more than the grading).
CHUNKS_PER_WORKER = 2
MIN_CHUNK = 8


class RewardError(RuntimeError):
    """A reward raised while grading, or a reward worker died: the batch has no grades."""


def grade_pair(rewards: Mapping[str, tuple[Any, float]], prompt: Prompt, text: str, parses: bool) -> RawGrade:
    """Each reward's value for `text` (rewards from build_rewards), and with `parses` whether every reward with a
    `parses` method finds an answer in it; a reward that raises becomes a RewardError naming it."""
    values: dict[str, float] = {}
    for name, (fn, _) in rewards.items():
        try:
            values[name] = float(fn(prompt, text))
        except Exception as e:
            raise RewardError(f"reward {name!r} ({type(fn).__name__}) raised {type(e).__name__}: {e} on the completion "
                              f"{text[:200]!r} (reference answer {prompt.answer!r})") from e
    parsed = all(bool(fn.parses(prompt, text)) for fn, _ in rewards.values() if hasattr(fn, "parses")) if parses else None
    return values, parsed


def picklable_specs(rewards: Mapping[str, Any]) -> dict[str, Any]:
    """`rewards` (build_rewards' input) as plain containers a spawned worker can unpickle: config nodes become dicts,
    reward objects given as such must pickle (a class importable by the worker); else a ValueError says what to do."""
    from omegaconf import DictConfig, OmegaConf

    specs = {}
    for name, spec in rewards.items():
        plain = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else spec
        try:
            pickle.dumps(plain)
        except Exception as e:
            raise ValueError(f"data.rewards.{name} ({type(plain).__name__}) cannot be sent to the reward worker processes "
                             f"({e}): give it as a config node with a _target_, or set data.reward_workers=0") from None
        specs[str(name)] = plain
    return specs


# ---------------------------------------------------------------- inside a worker process
_worker: dict[str, Any] = {}


def _start_worker(build: Callable[[Mapping[str, Any]], Any], specs: Mapping[str, Any], parent_pid: int) -> None:
    """Worker initializer. The rewards are built on the first chunk, so that an error there reaches the parent as the
    chunk's exception (an initializer's error only breaks the pool)."""
    # Ctrl-C reaches the whole process group: the parent stops the run and closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker.update(build=build, specs=specs, rewards=None)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True, name="grpo-parent-watch").start()


def _exit_with_parent(parent_pid: int) -> None:
    """A parent killed without close() (SIGKILL) leaves no worker behind: its workers exit when it is gone."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _worker_rewards() -> Any:
    if _worker["rewards"] is None:
        _worker["rewards"] = _worker["build"](_worker["specs"])
    return _worker["rewards"]


def _warm_up() -> int:
    _worker_rewards()
    return os.getpid()


def _grade_chunk(pairs: list[Pair], parses: bool) -> list[RawGrade]:
    rewards = _worker_rewards()
    return [grade_pair(rewards, prompt, text, parses) for prompt, text in pairs]


# ---------------------------------------------------------------- the parent's side
class RewardPool:
    """`workers` spawned processes that build rewards with `build(specs)` (build_rewards and picklable_specs) and
    grade chunks of (prompt, text) pairs. Started here, stopped (and joined) by close()."""

    def __init__(self, specs: Mapping[str, Any], build: Callable[[Mapping[str, Any]], Any], workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a reward pool needs >= 1 worker, got {workers}")
        self.workers = int(workers)
        self._executor = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_start_worker,
                                             initargs=(build, dict(specs), os.getpid()))
        # The executor spawns a process per task it cannot hand to an idle one: these start every worker now (their
        # imports and reward building take seconds), not on the first batch. An error building the rewards is raised
        # again by the first chunk.
        for _ in range(self.workers):
            self._executor.submit(_warm_up)

    def submit(self, pairs: Sequence[Pair], parses: bool) -> list[tuple[int, Future]]:
        """`pairs` in chunks over the workers: (first index, future of the chunk's RawGrades) per chunk."""
        size = max(MIN_CHUNK, math.ceil(len(pairs) / (self.workers * CHUNKS_PER_WORKER)))
        return [(start, self._executor.submit(_grade_chunk, list(pairs[start:start + size]), parses))
                for start in range(0, len(pairs), size)]

    def close(self) -> None:
        """Stop the workers and wait for them to exit; chunks not started are dropped."""
        self._executor.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class Grade:
    """One completion's grade: each reward's value, their weighted sum, and whether the rewards parse it (None when
    not asked)."""

    values: dict[str, float]
    total: float
    parsed: Optional[bool]


class PendingGrades:
    """The grades of one submitted batch, in submission order; `result()` waits for them."""

    def __init__(self, weights: Mapping[str, float], slots: list[int], chunks: list[tuple[int, Future]],
                 done: Optional[list[RawGrade]] = None) -> None:
        self._weights, self._slots, self._chunks, self._done = weights, slots, chunks, done
        # Distinct pairs graded for this batch (slots number them densely from 0); its completions are len(slots).
        self.distinct = max(slots, default=-1) + 1

    def result(self) -> list[Grade]:
        """The grades; raises RewardError when a reward raised or a worker died."""
        if self._done is None:
            raw: list[RawGrade] = []
            for _, future in self._chunks:
                try:
                    raw.extend(future.result())
                except BrokenProcessPool as e:
                    raise RewardError(f"a reward worker process died while grading ({e}): out of memory, or killed? "
                                      "Set data.reward_workers=0 to grade in the trainer process") from e
            self._done = raw
        out = []
        for slot in self._slots:
            values, parsed = self._done[slot]
            out.append(Grade(values, sum(w * values[name] for name, w in self._weights.items()), parsed))
        return out


class Grader:
    """Grades batches of (prompt, text) pairs with `rewards` (build_rewards' output), each distinct pair once per
    batch: in this process when `workers` is 0, else in a RewardPool of `workers` processes that build the rewards
    with `build(specs)`. The pool starts with start() (its owner's setup), or else with the first batch."""

    def __init__(self, rewards: Mapping[str, tuple[Any, float]], specs: Optional[Mapping[str, Any]] = None,
                 build: Optional[Callable[[Mapping[str, Any]], Any]] = None, workers: int = 0) -> None:
        if workers < 0:
            raise ValueError(f"data.reward_workers must be >= 0 (0 = grade in the trainer process), got {workers}")
        if workers and (specs is None or build is None):
            raise ValueError("a Grader with reward workers needs the rewards' specs and the function that builds them")
        self.rewards = dict(rewards)
        self.weights = {name: float(weight) for name, (_, weight) in self.rewards.items()}
        self.specs, self.build, self.workers = specs, build, int(workers)
        self.pool: Optional[RewardPool] = None

    def start(self) -> None:
        """Start the worker processes now (their imports take seconds), unless they run or none are asked for."""
        if self.workers and self.pool is None:
            self.pool = RewardPool(self.specs, self.build, self.workers)

    def submit(self, pairs: Sequence[Pair], parses: bool = False) -> PendingGrades:
        """Start grading `pairs` (in this process: graded before it returns); `parses`: also ask the rewards' `parses`."""
        index: dict[Pair, int] = {}
        slots = [index.setdefault(pair, len(index)) for pair in pairs]
        distinct = list(index)
        if not self.workers:
            done = [grade_pair(self.rewards, prompt, text, parses) for prompt, text in distinct]
            return PendingGrades(self.weights, slots, [], done)
        self.start()
        return PendingGrades(self.weights, slots, self.pool.submit(distinct, parses))

    def grade(self, pairs: Sequence[Pair], parses: bool = False) -> list[Grade]:
        """`submit(pairs, parses).result()`."""
        return self.submit(pairs, parses).result()

    def close(self) -> None:
        """Stop the worker processes (none in this process's mode); a later batch or start() starts them again."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

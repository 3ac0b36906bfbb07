"""Asynchronous rollouts (`train.max_staleness >= 1`): a producer thread generates the next rollout batches while the
trainer trains on the current one, through a bounded queue; groups too old at train time are dropped and counted.

`AsyncRollouts` wraps a `LocalRolloutPipeline` (any `DataPipeline` whose `next_groups(index)` is a pure function of
the index and the served weights). Generation is HTTP to the vLLM server, so one Python thread overlaps it with the
trainer's forward/backward (the GIL is released in the socket reads and in torch's kernels).

Indices and versions. Rollout batch `j` is the groups of `inner.next_groups(j)` (local prompts are a function of
(seed, j)). The trainer takes batches in index order; `taken` is the index of the last one it took. Each group
carries `weight_version` (the version served when its requests were sent: at most the version of any of its tokens)
and `last_weight_version` (the version served when the last completion came back: at least the version of any of
its tokens); a sync that lands during generation makes them differ. A group's lag when the trainer takes it is
`current version - weight_version` (the oldest token's bound); a group with lag > `max_staleness` is dropped.

When the producer may start batch `j` (the queue bound): when fewer than `capacity` batches are generated and not yet
taken (`j - taken - 1 < capacity`).
- `stale_policy=wait` (default): capacity = `max_staleness`. Batch j starts no earlier than the trainer takes batch
  j - k, and the trainer syncs at most once per batch it trains, so every group is trained with lag <= k: the
  generator waits instead of producing groups that would be dropped. k = 1 is one-step-off (verl, AReaL's k=1).
- `stale_policy=drop`: capacity = `train.rollout_queue` (default max_staleness + 1): the producer runs further ahead
  and idles less; a group whose lag exceeds k when taken is dropped (`async/dropped_groups`) and the trainer takes
  the next batch, so a step still trains fresh groups.

Syncs with generation in flight: the inner pipeline generates through the sync strategy's `GenerationGate`
(`PipelineContext.generation_gate`), so a sync that restarts the server drains the producer's requests first and
holds new ones until the server is back; what each mode does and the stall it causes (`sync/gen_stall_seconds`) is
in README "Asynchronous rollouts".

Counts: `async/generated_groups = async/trained_groups + async/dropped_groups_total + async/queued_groups` at every
step (totals of this process; the queue is not checkpointed).

Errors and stops. An exception in the producer (e.g. the server died) is queued behind the batches generated before
it, and the producer thread ends; the trainer raises it from `next_batch` as the synchronous path would, the sync
strategy recovers (`sync.recover`: restarts a dead server, bounded by `server.max_restarts`) and the trainer's retry
restarts the producer at the failed index. The trainer's waits poll the producer, so a producer that died without
queueing anything is an error, never a hang. `close()` (train.py's `finally`, also on Ctrl-C/SIGTERM) sets a stop
flag the producer checks between requests and between waits, and joins it for at most `STOP_JOIN_S` (the thread is a
daemon: a request still in flight ends with the server, which train.py stops next).

Checkpoint/resume guarantee. `state_dict()` holds the index of the last batch the trainer took (trained or dropped),
never the producer's position: batches in the queue at a checkpoint are discarded, and a resumed run generates them
again (same prompts, the resumed weights). So a prompt batch is trained at most once and, unless dropped as stale,
exactly once, in the same index order as a synchronous run; a batch generated but not yet trained at a stop costs
only its generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from grpo.pipeline.base import DataPipeline, PipelineContext
from grpo.pipeline.group import Group

log = logging.getLogger(__name__)

STALE_POLICIES = ("wait", "drop")
# How long close() waits for the producer thread before leaving it (a daemon) to the server's shutdown.
STOP_JOIN_S = 3.0
# Poll interval of every wait (stop flag, producer liveness).
_POLL_S = 0.1


@dataclass
class _Batch:
    """What the producer queued for rollout batch `index`: its groups and generation metrics, or its error."""

    index: int
    groups: list[Group] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    error: Optional[BaseException] = None


class AsyncRollouts(DataPipeline):
    """A producer thread runs `inner.next_groups(j)` for j = first, first + 1, ... ahead of the trainer (see the
    module docstring for the bound, the staleness rule, errors, stops and the resume guarantee)."""

    def __init__(self, inner: DataPipeline, max_staleness: int, stale_policy: str = "wait",
                 rollout_queue: Optional[int] = None) -> None:
        if max_staleness < 1:
            raise ValueError(f"AsyncRollouts needs train.max_staleness >= 1 (0 is the synchronous loop), got {max_staleness}")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"train.stale_policy must be one of {STALE_POLICIES}, got {stale_policy!r}")
        self.inner = inner
        self.max_staleness = int(max_staleness)
        self.stale_policy = stale_policy
        if stale_policy == "wait":
            self.capacity = self.max_staleness
        else:
            self.capacity = self.max_staleness + 1 if rollout_queue is None else int(rollout_queue)
        if self.capacity < 1:
            raise ValueError(f"train.rollout_queue must be >= 1, got {rollout_queue}")
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ready: deque[_Batch] = deque()
        self._thread: Optional[threading.Thread] = None
        self._next_gen: Optional[int] = None  # the index the producer generates next
        self._taken: Optional[int] = None  # the index of the last batch the trainer took (trained or dropped)
        self._idle_s = 0.0  # producer seconds waiting for room since the trainer's last take
        self.totals = {"generated": 0, "trained": 0, "dropped": 0}
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ DataPipeline
    def setup(self, ctx: PipelineContext) -> None:
        self.inner.setup(ctx)
        self.ctx = ctx
        self.data_warnings = self.inner.data_warnings

    def state_dict(self) -> dict:
        """The inner pipeline's format: the last index the trainer took (the queue is not saved)."""
        return {"step": self._taken}

    def load_state_dict(self, state: dict) -> None:
        self._taken = state.get("step")
        self.inner.load_state_dict(state)

    def next_groups(self, step: int) -> list[Group]:
        """The fresh groups of the next batch in index order (taking further batches while every group of one is
        stale); `step` (the trainer's batch number) only places the producer's first index on a fresh start."""
        if self._taken is None:
            self._taken = step - 1
        t0 = time.monotonic()
        dropped = 0
        while True:
            batch = self._take()
            current = self.ctx.endpoint().version
            fresh = [g for g in batch.groups if self._lag(g, current) <= self.max_staleness]
            stale = len(batch.groups) - len(fresh)
            dropped += stale
            self.totals["dropped"] += stale
            if stale:
                log.warning("rollout batch %d: %d of %d groups older than train.max_staleness=%d versions dropped",
                            batch.index, stale, len(batch.groups), self.max_staleness)
            if fresh:
                break
        lags = [self._lag(g, current) for g in fresh]
        self.totals["trained"] += len(fresh)
        with self._cond:
            queued = sum(len(b.groups) for b in self._ready)
            depth = len(self._ready)
            idle, self._idle_s = self._idle_s, 0.0
        self.step = batch.index
        self.inner.step = batch.index
        mid_sync = sum(g.last_weight_version is not None and g.last_weight_version != g.weight_version for g in fresh)
        self.last_metrics = {
            **batch.metrics,
            "async/staleness_mean": sum(lags) / len(lags),
            "async/staleness_max": float(max(lags)),
            "async/dropped_groups": float(dropped),
            "async/dropped_groups_total": float(self.totals["dropped"]),
            "async/mid_sync_groups": float(mid_sync),
            "async/queue_depth": float(depth),
            "async/queued_groups": float(queued),
            "async/generated_groups": float(self.totals["generated"]),
            "async/trained_groups": float(self.totals["trained"]),
            "async/trainer_wait_seconds": time.monotonic() - t0,
            "async/generator_idle_seconds": idle,
            "async/rollout_index": float(batch.index),
        }
        return fresh

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(STOP_JOIN_S)
            if thread.is_alive():
                log.warning("rollout producer still in a request after %.0f s; left to end with the server", STOP_JOIN_S)
        self.inner.close()

    # ------------------------------------------------------------------ trainer side
    @staticmethod
    def _lag(group: Group, current: int) -> int:
        version = group.weight_version if group.weight_version is not None else current
        return current - int(version)

    def _take(self) -> _Batch:
        """The next batch in index order; starts (or restarts, after an error) the producer; raises its error."""
        self._ensure_producer()
        with self._cond:
            while not self._ready:
                if self._stop.is_set():
                    raise RuntimeError("the rollout producer was stopped")
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("the rollout producer ended without queueing a batch or an error")
                self._cond.wait(_POLL_S)
            batch = self._ready.popleft()
            if batch.error is not None:
                # The producer ended on this index; the trainer's retry (after sync.recover) restarts it here.
                self._next_gen = batch.index
                self._thread = None
                raise batch.error
            self._taken = batch.index
            self._cond.notify_all()
        return batch

    def _ensure_producer(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        if self._stop.is_set():
            raise RuntimeError("the rollout producer was stopped")
        with self._cond:
            if any(b.error is not None for b in self._ready):
                # The producer ended on an error the trainer has not taken yet: starting another now would generate
                # that index twice (once here, once on the retry after the error is raised).
                return
            if self._next_gen is None or self._next_gen <= self._taken:
                self._next_gen = self._taken + 1
        self._thread = threading.Thread(target=self._produce, name="grpo-rollout-producer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def _may_start(self, index: int) -> bool:
        return index - self._taken - 1 < self.capacity

    def _produce(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                t0 = time.monotonic()
                while not self._stop.is_set() and not self._may_start(self._next_gen):
                    self._cond.wait(_POLL_S)
                self._idle_s += time.monotonic() - t0
                if self._stop.is_set():
                    return
                index = self._next_gen
            try:
                groups = self.inner.next_groups(index)
                batch = _Batch(index, groups, self.inner.metrics())
            except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it
                if self._stop.is_set():
                    return
                log.warning("rollout producer: batch %d failed (%s); the trainer gets the error", index, error)
                with self._cond:
                    self._ready.append(_Batch(index, error=error))
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready.append(batch)
                self.totals["generated"] += len(groups)
                self._next_gen = index + 1
                self._cond.notify_all()

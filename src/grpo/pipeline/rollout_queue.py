"""Asynchronous rollouts (`train.max_staleness >= 1`): a producer thread generates the next rollout batches while the
trainer trains on the current one, through a bounded queue; groups too old at train time are dropped and counted.

`AsyncRollouts` wraps a `LocalRolloutPipeline` (any `DataPipeline` whose `rollout_batch(index)` is a pure function of
the index and the served weights). Generation is HTTP to the vLLM server, so one Python thread overlaps it with the
trainer's forward/backward (the GIL is released in the socket reads and in torch's kernels).

Indices and versions. Rollout batch `j` is the groups of `inner.rollout_batch(j)` (local prompts are a function of
(seed, j)). The trainer takes batches in index order; `taken` is the index of the last one it took. Each group
carries `weight_version` (the version served when its requests were sent: at most the version of any of its tokens)
and `last_weight_version` (the version served when the last completion came back: at least the version of any of
its tokens); a sync that lands during generation makes them differ. A group's lag when the trainer takes it is
`current version - weight_version` (the oldest token's bound); a group with lag > `max_staleness` is dropped.

When the producer may start batch `j` (the queue bound), by policy:
- `stale_policy=wait` (default): once the trainer has finished batch j - k - 1 (trained it and synced: it asks for
  the next batch only then; `done` below), i.e. `j - done - 1 < capacity` with capacity = `max_staleness + 1`. Batch
  j is trained after batches j - k, ..., j - 1, and the trainer syncs at most once per batch it trains, so every group
  is trained with lag <= k: the generator waits instead of producing groups that would be dropped. The bound counts
  from the last batch *finished*, not the last *taken*: while the trainer waits for batch j - k it has already
  finished j - k - 1, so batch j may generate beside j - k at the same lag bound (the versions gate the start, as
  AReaL's staleness control does). With one batch in flight that changes little; with two, a generation-bound run
  at k = 1 overlaps consecutive batches. k = 1 is one-step-off (verl, AReaL's k=1).
- `stale_policy=drop`: fewer than capacity = `train.rollout_queue` (default max_staleness + 1) batches generated and
  not yet taken (`j - taken - 1 < capacity`): the producer runs further ahead and idles less; a group whose lag
  exceeds k when taken is dropped (`async/dropped_groups`) and the trainer takes the next batch, so a step still
  trains fresh groups.

The producer also turns each batch into micro-batches (advantages, padding: `prepare`), off the trainer's path; the
trainer takes them ready unless it dropped stale groups from the batch, which it then prepares itself.

Several batches in flight (`train.rollout_batches_in_flight = n`, default 1): n producer threads each claim the next
index the bound allows and generate it, so up to n /generate calls are at the server at once (vLLM batches them, and
its API process works on one call while its engine computes the other: 0.065 s per call against 0.080 s one at a
time on the 2-core CPU machine, bench/README.md). Needs n <= capacity and an inner pipeline whose `rollout_batch`
may run in several threads (`concurrent_batches`: LocalRolloutPipeline). Batches are taken in index order whatever
order they finish in.

Syncs with generation in flight: the inner pipeline generates through the server's `GenerationGate` (its
`PipelineContext.generation` passes it), so a sync that restarts the server drains the producer's requests first and
holds new ones until the server is back; what each mode does and the stall it causes (`sync/gen_stall_seconds`) is
in docs/async.md.

Counts: `async/generated_groups = async/trained_groups + async/dropped_groups_total + async/queued_groups` at every
step (totals of this process; the queue is not checkpointed).

Errors and stops. An exception in the producer (e.g. the server died) is stored at its batch's index and the
producer claims no further index; the trainer raises it from `next_batch` when it reaches that index, as the
synchronous path would, the server recovers (`sync.server.recover`: restarts a dead replica, bounded by
`server.max_restarts`) and the trainer's retry restarts the producer at the failed index. Each start is an epoch:
batches past the failed one, and the threads still generating them, belong to the old epoch and are discarded (they
are generated again, in order). The trainer's waits poll the producer, so a producer that died without
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
from dataclasses import dataclass, field
from typing import Optional

from grpo.pipeline.base import DataPipeline, PipelineContext
from grpo.pipeline.batching import WarnOnce
from grpo.pipeline.group import Group
from grpo.pipeline.source_checks import check_batches_in_flight, queue_capacity
from grpo.schema.train import StalePolicy
from grpo.trainer.train_batch import PreparedBatch

log = logging.getLogger(__name__)


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
    # The groups as micro-batches, made by the producer off the trainer's path; None = made at take time (the
    # producer's attempt failed: the trainer's own attempt raises the error where the synchronous loop would).
    prepared: Optional[PreparedBatch] = None


class AsyncRollouts(DataPipeline):
    """Producer threads run `inner.rollout_batch(j)` for j = first, first + 1, ... ahead of the trainer (see the
    module docstring for the bound, the staleness rule, several batches in flight, errors, stops and the resume
    guarantee)."""

    def __init__(self, inner: DataPipeline, max_staleness: int, stale_policy: str = "wait",
                 rollout_queue: Optional[int] = None, batches_in_flight: int = 1) -> None:
        if max_staleness < 1:
            raise ValueError(f"AsyncRollouts needs train.max_staleness >= 1 (0 is the synchronous loop), got {max_staleness}")
        if stale_policy not in StalePolicy.__members__:
            raise ValueError(f"train.stale_policy must be one of {tuple(StalePolicy.__members__)}, got {stale_policy!r}")
        self.inner = inner
        self.max_staleness = int(max_staleness)
        self.stale_policy = stale_policy
        self.capacity = queue_capacity(self.max_staleness, stale_policy, rollout_queue)
        if self.capacity < 1:
            raise ValueError(f"train.rollout_queue must be >= 1, got {rollout_queue}")
        check_batches_in_flight(batches_in_flight, self.capacity, type(inner))
        self.batches_in_flight = int(batches_in_flight)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ready: dict[int, _Batch] = {}  # generated, not yet taken, by index
        self._workers: list[threading.Thread] = []  # the producer threads of the current epoch
        # Each (re)start of the producer is a new epoch; a thread of an older one stores nothing and claims nothing.
        self._epoch = 0
        self._failed = False  # a batch of this epoch failed: its threads claim no further index
        self._next_gen: Optional[int] = None  # the next index a producer thread claims
        self._taken: Optional[int] = None  # the index of the last batch the trainer took (trained or dropped)
        # The last batch the trainer finished (trained and synced, or dropped): it asks for the next one only then.
        self._done: Optional[int] = None
        self._idle_s = 0.0  # producer seconds waiting for room since the trainer's last take (summed over threads)
        self.totals = {"generated": 0, "trained": 0, "dropped": 0}
        self.last_metrics: dict[str, float] = {}

    def __repr__(self) -> str:
        return (f"AsyncRollouts({type(self.inner).__name__}, max_staleness={self.max_staleness}, "
                f"stale_policy={self.stale_policy}, capacity={self.capacity}, batches_in_flight={self.batches_in_flight})")

    # ------------------------------------------------------------------ DataPipeline
    def start_workers(self) -> None:
        self.inner.start_workers()

    def setup(self, ctx: PipelineContext) -> None:
        self.inner.setup(ctx)
        self.ctx = ctx
        if self.inner.data_warnings is None:
            self.inner.data_warnings = WarnOnce()
        self.data_warnings = self.inner.data_warnings  # one set for both threads (warned once per run)

    def state_dict(self) -> dict:
        """The inner pipeline's format: the last index the trainer took (the queue is not saved)."""
        return {"step": self._taken}

    def load_state_dict(self, state: dict) -> None:
        self._taken = state.get("step")
        self.inner.load_state_dict(state)

    def next_groups(self, step: int) -> list[Group]:
        """The fresh groups of the next batch in index order (taking further batches while every group of one is
        stale); `step` (the trainer's batch number) only places the producer's first index on a fresh start."""
        return self._next_fresh(step)[1]

    def next_batch(self, step: int) -> PreparedBatch:
        """next_groups(step) as micro-batches: those the producer prepared when no group was dropped."""
        batch, fresh = self._next_fresh(step)
        if batch.prepared is not None and len(fresh) == len(batch.groups):
            return batch.prepared
        return self.prepare(fresh)

    def _next_fresh(self, step: int) -> tuple[_Batch, list[Group]]:
        """The next batch taken in index order with at least one fresh group, and its fresh groups."""
        if self._taken is None:
            self._taken = step - 1
        t0 = time.monotonic()
        dropped = 0
        while True:
            batch = self._take()
            current = self.ctx.generation.version()
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
            queued = sum(len(b.groups) for b in self._ready.values())
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
        return batch, fresh

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            workers, self._workers = self._workers, []
        deadline = time.monotonic() + STOP_JOIN_S
        for thread in workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in workers):
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
            self._done = self._taken  # asking for the next batch: the last one taken is trained and synced
            self._cond.notify_all()
            index = self._taken + 1
            while index not in self._ready:
                if self._stop.is_set():
                    raise RuntimeError("the rollout producer was stopped")
                # Every index below _next_gen was claimed by a thread of this epoch, which stores it before it ends.
                if not any(thread.is_alive() for thread in self._workers):
                    raise RuntimeError("the rollout producer ended without queueing a batch or an error")
                self._cond.wait(_POLL_S)
            batch = self._ready.pop(index)
            if batch.error is not None:
                # The producer stops on this index; the trainer's retry (after sync.server.recover) restarts it here, in a new
                # epoch: batches generated past it are discarded (they are generated again, in order).
                self._discard_epoch()
                raise batch.error
            self._taken = index
            self._cond.notify_all()
        return batch

    def _discard_epoch(self) -> None:
        """Under the lock: leave the current producer threads to end on their own and drop what they queued."""
        self.totals["generated"] -= sum(len(b.groups) for b in self._ready.values())
        self._ready.clear()
        self._workers = []
        self._epoch += 1
        self._failed = False
        self._cond.notify_all()

    def _ensure_producer(self) -> None:
        with self._cond:
            if self._failed or any(thread.is_alive() for thread in self._workers):
                # Running, or ended on an error the trainer has not taken yet: starting threads now would generate
                # that index twice (once here, once on the retry after the error is raised).
                return
            if self._stop.is_set():
                raise RuntimeError("the rollout producer was stopped")
            self._discard_epoch()
            self._next_gen = self._taken + 1
            self._done = self._taken
            self._workers = [
                threading.Thread(target=self._produce, args=(self._epoch,), name=f"grpo-rollout-producer-{i}",
                                 daemon=True)
                for i in range(self.batches_in_flight)
            ]
            for thread in self._workers:
                thread.start()

    # ------------------------------------------------------------------ producer side
    def _may_start(self, index: int) -> bool:
        # wait: counted from the last batch finished (the lag bound); drop: from the last taken (a queue bound).
        reference = self._done if self.stale_policy == "wait" else self._taken
        return index - reference - 1 < self.capacity

    def _ended(self, epoch: int) -> bool:
        return self._stop.is_set() or epoch != self._epoch or self._failed

    def _claim(self, epoch: int) -> Optional[int]:
        """The next index to generate once the queue bound allows it, or None when this thread should end."""
        with self._cond:
            t0 = time.monotonic()
            while not self._ended(epoch) and not self._may_start(self._next_gen):
                self._cond.wait(_POLL_S)
            self._idle_s += time.monotonic() - t0
            if self._ended(epoch):
                return None
            index = self._next_gen
            self._next_gen = index + 1
            return index

    def _produce(self, epoch: int) -> None:
        while (index := self._claim(epoch)) is not None:
            try:
                groups, metrics = self.inner.rollout_batch(index)
                batch = _Batch(index, groups, metrics, prepared=self._prepare_ahead(groups))
            except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it
                batch = _Batch(index, error=error)
            with self._cond:
                if self._stop.is_set() or epoch != self._epoch:
                    return
                self._ready[index] = batch
                if batch.error is not None:
                    log.warning("rollout producer: batch %d failed (%s); the trainer gets the error", index, batch.error)
                    self._failed = True
                else:
                    self.totals["generated"] += len(batch.groups)
                self._cond.notify_all()


    def _prepare_ahead(self, groups: list[Group]) -> Optional[PreparedBatch]:
        """The micro-batches of `groups`, or None where this pipeline yields groups only or preparing them fails."""
        if self.ctx.batch_shape is None:
            return None
        try:
            return self.prepare(groups)
        except Exception:  # noqa: BLE001 - the trainer prepares them again and gets the error in its own thread
            return None

"""Issue 18: asynchronous rollouts (grpo.pipeline.rollout_queue.AsyncRollouts) against a scripted pipeline, no
server: the staleness bound, drops and counts, errors and restarts, the stop, the resume position. The real server
and train.py are in test_async_train.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from grpo.conf import CONFIG_DIR
from grpo.inference.client import Endpoint, ServerUnreachable
from grpo.pipeline.base import BatchShape, DataPipeline, PipelineContext
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.group import Group
from grpo.pipeline.rollout_queue import AsyncRollouts


class Server:
    """The weight version a trainer's syncs advance (what PipelineContext.endpoint reports)."""

    def __init__(self) -> None:
        self.version = 0

    def endpoint(self) -> Endpoint:
        return Endpoint("http://fake", None, self.version)


class Scripted(DataPipeline):
    """Two groups per batch, `gen_s` seconds of 'generation'; `fail` = indices whose first attempt raises."""

    def __init__(self, gen_s: float = 0.0, fail: tuple[int, ...] = (), block: threading.Event | None = None):
        self.gen_s = gen_s
        self.fail = set(fail)
        self.block = block
        self.calls: list[int] = []

    def setup(self, ctx: PipelineContext) -> None:
        self.ctx = ctx

    def next_groups(self, step: int) -> list[Group]:
        self.calls.append(step)
        first = self.ctx.generation.version()
        if self.block is not None:
            self.block.wait()
        time.sleep(self.gen_s)
        if step in self.fail:
            self.fail.discard(step)
            raise ServerUnreachable(f"batch {step}: connection refused")
        groups = []
        for i in range(2):
            g = Group.sampled([1, 2, step % 50 + 3], [[4, 5], [6, 7]], [[-0.5, -0.7], [-0.2, -0.9]], [float(i), 1.0 - i],
                              1.0, weight_version=first)
            g.last_weight_version = self.ctx.generation.version()
            groups.append(g)
        self.last_metrics = {"generation/seconds": self.gen_s, "data/index": float(step)}
        return groups


class ConcurrentScripted(Scripted):
    """Scripted whose rollout_batch may run in several threads: it records how many run at once; batch `j` takes
    `gen_s(j)` seconds, so later batches can finish first."""

    concurrent_batches = True

    def __init__(self, gen_s, fail: tuple[int, ...] = ()):
        super().__init__(fail=fail)
        self.gen_time = gen_s
        self.lock = threading.Lock()
        self.running = 0
        self.most_running = 0
        self.finished: list[int] = []

    def rollout_batch(self, step: int):
        with self.lock:
            self.calls.append(step)
            attempt = self.calls.count(step)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            failing = step in self.fail
            self.fail.discard(step)
        first = self.ctx.generation.version()
        time.sleep(self.gen_time(step))
        with self.lock:
            self.running -= 1
            self.finished.append(step)
        if failing:
            raise ServerUnreachable(f"batch {step}: connection refused")
        g = Group.sampled([1, 2, step % 50 + 3], [[4, 5], [6, 7]], [[-0.5, -0.7], [-0.2, -0.9]], [0.0, 1.0], 1.0,
                          weight_version=first)
        g.last_weight_version = self.ctx.generation.version()
        return [g, g], {"data/index": float(step), "data/attempt": float(attempt)}


def make(inner: Scripted, server: Server, k: int = 1, policy: str = "wait", queue=None, in_flight: int = 1) -> AsyncRollouts:
    src = AsyncRollouts(inner, k, policy, queue, in_flight)
    src.setup(PipelineContext(
        tokenizer=None,
        generation=GenerationHandle(server.endpoint),
        batch_size=4, max_seq_len=64, run_dir=Path("/tmp"), total_steps=10,
        start_step=0, checkpoint_every=5, seed=0,
        batch_shape=BatchShape(micro_batch_size=4, max_seq_len=64, pad_token_id=0),
    ))
    return src


def train(src: AsyncRollouts, server: Server, batches: int, start: int = 0, train_s: float = 0.0) -> list[dict]:
    """The trainer's side of the loop: take a batch, 'train', sync (the version advances once per batch)."""
    rows = []
    for b in range(start, start + batches):
        src.next_batch(b)
        rows.append(src.metrics())
        time.sleep(train_s)
        server.version += 1
    return rows


def counts_add_up(m: dict) -> bool:
    return m["async/generated_groups"] == m["async/trained_groups"] + m["async/dropped_groups_total"] + m["async/queued_groups"]


@pytest.mark.parametrize("k", [1, 2])
def test_wait_policy_bounds_lag_by_k_drops_nothing_and_counts_add_up(k):
    server, inner = Server(), Scripted(gen_s=0.01)
    src = make(inner, server, k=k)
    try:
        rows = train(src, server, 8, train_s=0.03)  # a fast generator: it runs ahead as far as it may
    finally:
        src.close()
    assert [r["async/rollout_index"] for r in rows] == list(range(8))
    assert all(r["async/staleness_max"] <= k for r in rows)
    assert max(r["async/staleness_max"] for r in rows) == k  # it did run k batches ahead
    assert sum(r["async/dropped_groups"] for r in rows) == 0
    assert all(counts_add_up(r) for r in rows)
    assert all(r["async/queue_depth"] <= k for r in rows)
    assert {"async/trainer_wait_seconds", "async/generator_idle_seconds", "generation/seconds"} <= set(rows[0])
    assert rows[-1]["async/generator_idle_seconds"] > 0  # it waited for the trainer


def test_drop_policy_runs_ahead_and_drops_groups_older_than_k_then_takes_the_next_batch():
    server, inner = Server(), Scripted(gen_s=0.0)
    src = make(inner, server, k=1, policy="drop", queue=3)
    try:
        rows = train(src, server, 4, train_s=0.05)
    finally:
        src.close()
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    dropped = sum(r["async/dropped_groups"] for r in rows)
    assert dropped > 0 and dropped == rows[-1]["async/dropped_groups_total"]
    indices = [r["async/rollout_index"] for r in rows]
    assert indices == sorted(set(indices)) and indices[-1] > 3  # dropped batches are skipped, never trained
    assert all(counts_add_up(r) for r in rows)


def test_a_producer_error_reaches_the_trainer_in_order_and_the_retry_restarts_at_that_index():
    server, inner = Server(), Scripted(gen_s=0.05, fail=(2,))
    src = make(inner, server, k=1)
    try:
        train(src, server, 2)
        # Let the producer fail on batch 2 and end before the trainer asks: a take must not start a second producer
        # while the error is still queued (that generated batch 2 twice: CI's flake of 2026-11-24).
        deadline = time.monotonic() + 5
        while inner.calls.count(2) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        with pytest.raises(ServerUnreachable):
            src.next_batch(2)
        # The trainer's retry (after sync.recover) regenerates batch 2, then goes on.
        rows = train(src, server, 2, start=2)
    finally:
        src.close()
    assert [r["async/rollout_index"] for r in rows] == [2, 3]
    assert inner.calls.count(2) == 2 and inner.calls.count(1) == 1
    assert all(counts_add_up(r) for r in rows)


def test_close_stops_a_waiting_producer_at_once_and_a_busy_one_without_hanging():
    server, inner = Server(), Scripted()
    src = make(inner, server, k=1)
    train(src, server, 1)
    time.sleep(0.1)  # the producer has batch 1 ready and waits for room
    t0 = time.monotonic()
    src.close()
    assert time.monotonic() - t0 < 1.0
    # A producer stuck in a request: close() returns within its bound; the daemon thread ends with the server.
    block = threading.Event()
    src = make(Scripted(block=block), Server(), k=1)
    waiter = threading.Thread(target=lambda: pytest.raises(RuntimeError, src.next_batch, 0), daemon=True)
    waiter.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    src.close()
    assert time.monotonic() - t0 < 4.0
    waiter.join(2)
    assert not waiter.is_alive()  # the trainer's wait ends too (RuntimeError: stopped), never a hang
    block.set()


def test_resume_position_is_the_last_batch_taken_so_queued_batches_are_regenerated_never_trained_twice():
    server, inner = Server(), Scripted()
    src = make(inner, server, k=2)
    train(src, server, 3)
    time.sleep(0.1)
    state = src.state_dict()
    src.close()
    assert state == {"step": 2}
    assert max(inner.calls) == 4  # batches 3 and 4 were in the queue at the checkpoint: discarded
    again_inner = Scripted()
    again = make(again_inner, server, k=2)
    again.load_state_dict(state)
    try:
        rows = train(again, server, 2, start=3)
    finally:
        again.close()
    assert [r["async/rollout_index"] for r in rows] == [3, 4]
    assert min(again_inner.calls) == 3


def test_the_first_batch_is_the_synchronous_one():
    """Batch 0 is generated under version 0 in both loops: same groups, same prepared batch."""
    server = Server()
    sync = Scripted()
    sync.setup(make(Scripted(), server).ctx)
    expected = sync.next_batch(0)
    src = make(Scripted(), server, k=1)
    try:
        got = src.next_batch(0)
    finally:
        src.close()
    assert got.metrics == expected.metrics
    for a, b in zip(got.micro_batches, expected.micro_batches):
        assert all((getattr(a, f) is None and getattr(b, f) is None) or getattr(a, f).equal(getattr(b, f))
                   for f in ("input_ids", "labels", "loss_mask", "advantages"))


def test_k0_builds_the_synchronous_pipeline_and_k1_wraps_it():
    """k = 0 is today's loop by construction: train.py hands the trainer the pipeline itself, no producer."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.build import build_data
    from grpo.config import register_configs
    from grpo.pipeline.local import LocalRolloutPipeline

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        sync_cfg = compose(config_name="train")
        async_cfg = compose(config_name="train", overrides=["train.max_staleness=1"])
    assert sync_cfg.train.max_staleness == 0
    assert type(build_data(sync_cfg)) is LocalRolloutPipeline
    wrapped = build_data(async_cfg)
    assert isinstance(wrapped, AsyncRollouts) and type(wrapped.inner) is LocalRolloutPipeline
    assert wrapped.capacity == 2 and not wrapped._workers  # noqa: SLF001 - k + 1 from the last finished; nothing runs yet


def test_generation_gate_drains_in_flight_requests_and_holds_new_ones():
    """A restarting sync (SyncStrategy.stalling(drain=True)) waits for the generation in flight, keeps new generation
    out until it is done, and times both: the drain apart from the stall."""
    from grpo.sync.base import SyncStrategy

    class Restarting(SyncStrategy):
        def sync(self, model, step):
            return {}

    sync = Restarting()
    events: list[str] = []
    in_flight, release = threading.Event(), threading.Event()

    def generate(name: str, hold: bool) -> None:
        with sync.server.gate.generating():
            events.append(f"{name} sent")
            if hold:
                in_flight.set()
                release.wait(5)
            events.append(f"{name} done")

    first = threading.Thread(target=generate, args=("first", True))
    first.start()
    assert in_flight.wait(5)
    threading.Timer(0.3, release.set).start()  # the request in flight ends 0.3 s after the sync wants the server
    second = None
    with sync.stalling(drain=True):
        events.append("restart")
        second = threading.Thread(target=generate, args=("second", False))
        second.start()
        time.sleep(0.2)  # the new request waits at the gate meanwhile
        events.append("restarted")
    first.join(5)
    second.join(5)
    assert events == ["first sent", "first done", "restart", "restarted", "second sent", "second done"]
    stall = sync.take_generation_stall()
    assert stall["sync/drain_seconds"] >= 0.25 and stall["sync/gen_stall_seconds"] >= 0.2
    assert sync.server.gate.waited_s >= 0.15
    assert sync.take_generation_stall() == {"sync/gen_stall_seconds": 0.0, "sync/drain_seconds": 0.0}
    with sync.stalling():  # an in-place change: timed, nothing drained
        time.sleep(0.05)
    assert sync.take_generation_stall()["sync/drain_seconds"] == 0.0


def two_in_flight(k: int, gen_s) -> tuple[ConcurrentScripted, list[dict]]:
    """Eight batches with rollout_batches_in_flight=2 at max_staleness `k` (`gen_s(j)` seconds each, training 0.01 s):
    the inner pipeline and the trainer's rows, after what every such run must show: two calls at once, batches
    taken 0, 1, 2, ..., lag <= k, nothing dropped, counts that add up."""
    server = Server()
    inner = ConcurrentScripted(gen_s=gen_s)
    src = make(inner, server, k=k, in_flight=2)
    try:
        rows = train(src, server, 8, train_s=0.01)
    finally:
        src.close()
    assert inner.most_running == 2
    assert [r["async/rollout_index"] for r in rows] == list(range(8))
    assert all(r["async/staleness_max"] <= k for r in rows)
    assert sum(r["async/dropped_groups"] for r in rows) == 0
    assert all(counts_add_up(r) for r in rows)
    return inner, rows


def test_two_batches_in_flight_generate_at_once_and_are_taken_in_index_order_within_the_bound():
    """rollout_batches_in_flight=2: two calls at the server at once; odd batches finish before the even one started
    with them, yet the trainer gets 0, 1, 2, ... each batch's own metrics, lag <= k, counts that add up."""
    inner, rows = two_in_flight(2, lambda j: 0.12 if j % 2 == 0 else 0.03)
    assert any(inner.finished[i] > inner.finished[i + 1] for i in range(len(inner.finished) - 1))  # out of order
    assert [r["data/index"] for r in rows] == list(range(8))
    assert inner.calls == sorted(set(inner.calls))  # each index claimed once, in order


def test_one_step_off_with_two_in_flight_overlaps_consecutive_batches_without_exceeding_the_lag():
    """k = 1, stale_policy=wait, two batches in flight, generation slower than training: batch j + 1 starts once the
    trainer has finished batch j - 1, while it still waits for batch j, so two generate at once; every group is
    trained one version behind at most and nothing is dropped."""
    _, rows = two_in_flight(1, lambda j: 0.08)
    assert max(r["async/staleness_max"] for r in rows) == 1


def test_the_wait_bound_counts_from_the_batch_the_trainer_finished_not_the_one_it_took():
    """k = 1, one batch in flight: while the trainer trains batch 0 (taken, not finished) the producer may generate
    batch 1 only; batch 2 starts once the trainer asks for batch 1, i.e. has finished batch 0 and synced."""
    server = Server()
    inner = ConcurrentScripted(gen_s=lambda j: 0.0)
    src = make(inner, server, k=1)
    try:
        src.next_batch(0)
        time.sleep(0.3)  # the trainer "trains" batch 0: the producer runs as far as the bound lets it
        assert inner.calls == [0, 1]
        server.version += 1  # batch 0's sync
        src.next_batch(1)
        deadline = time.monotonic() + 5
        while 2 not in inner.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inner.calls == [0, 1, 2]
        assert src.metrics()["async/staleness_max"] <= 1
    finally:
        src.close()


def test_one_batch_in_flight_never_runs_two_calls_at_once():
    inner = ConcurrentScripted(gen_s=lambda j: 0.02)
    src = make(inner, Server(), k=2)
    try:
        train(src, Server(), 5)
    finally:
        src.close()
    assert inner.most_running == 1


def test_an_error_with_two_in_flight_discards_the_batches_past_it_and_the_retry_regenerates_them_in_order():
    """Batch 2 fails while batch 3 generates beside it: the trainer still gets 0 and 1, then batch 2's error; the
    retry generates 2 and 3 again (batch 3 of the failed epoch is discarded, never trained), and counts add up."""
    server = Server()
    inner = ConcurrentScripted(gen_s=lambda j: 0.05 if j != 2 else 0.01, fail=(2,))
    src = make(inner, server, k=2, in_flight=2)
    try:
        first = train(src, server, 2)
        deadline = time.monotonic() + 5
        while 3 not in inner.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 3 in inner.finished  # batch 3 of the failed epoch was generated...
        with pytest.raises(ServerUnreachable):
            src.next_batch(2)
        rows = train(src, server, 3, start=2)
    finally:
        src.close()
    assert [r["async/rollout_index"] for r in first + rows] == [0, 1, 2, 3, 4]
    assert inner.calls.count(2) == 2 and inner.calls.count(3) == 2  # ...and generated again after the retry
    assert [r["data/attempt"] for r in rows] == [2, 2, 1]  # what the trainer got of 2 and 3 is the retry's
    assert all(counts_add_up(r) for r in rows)
    assert rows[-1]["async/trained_groups"] == 10


@pytest.mark.parametrize("k, policy, queue, in_flight, inner, message", [
    (1, "wait", None, 3, ConcurrentScripted, "at most 2 rollout batches"),
    (2, "drop", 1, 2, ConcurrentScripted, "at most 1 rollout batches"),
    (2, "wait", None, 2, Scripted, "does one at a time"),
    (2, "wait", None, 0, ConcurrentScripted, "must be >= 1"),
])
def test_batches_in_flight_beyond_the_queue_bound_or_a_one_at_a_time_pipeline_are_refused(k, policy, queue, in_flight,
                                                                                          inner, message):
    built = inner(gen_s=lambda j: 0.0) if inner is ConcurrentScripted else inner()
    with pytest.raises(ValueError, match=message):
        AsyncRollouts(built, k, policy, queue, in_flight)

"""The data pipeline under torchrun (FSDP2): rank 0 runs the real pipeline and broadcasts each step's batch; the
other ranks receive it. Both are `BatchSource`s, as the trainer expects of any data source."""

from __future__ import annotations

from grpo.pipeline.base import DataPipeline
from grpo.trainer import fsdp
from grpo.trainer.train_batch import BatchSource, PreparedBatch


class LeaderPipeline(BatchSource):
    """Rank 0: batches from the run's pipeline, broadcast to the other ranks (every rank then takes its share)."""

    def __init__(self, inner: DataPipeline) -> None:
        self.inner = inner

    def next_batch(self, step: int) -> PreparedBatch:
        return fsdp.broadcast_object(self.inner.next_batch(step))

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


class FollowerPipeline(BatchSource):
    """Ranks > 0: the batch rank 0 broadcast; no server, no rollouts of their own."""

    def next_batch(self, step: int) -> PreparedBatch:
        return fsdp.broadcast_object(None)

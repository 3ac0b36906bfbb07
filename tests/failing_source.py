"""A local rollout pipeline whose source goes away after two rollout batches, as a run-api killed mid-run does
(`tests/test_sweep_report.py` runs it through train.py; the module is importable from tests/)."""

from __future__ import annotations

from grpo.pipeline.base import DataSourceError
from grpo.pipeline.local import LocalRolloutPipeline


class GoneAfterTwoBatches(LocalRolloutPipeline):
    """Generates like the local pipeline for rollout batches 0 and 1, then raises DataSourceError."""

    def next_groups(self, step: int):
        if step >= 2:
            raise DataSourceError("the data source stopped answering (test source)")
        return super().next_groups(step)

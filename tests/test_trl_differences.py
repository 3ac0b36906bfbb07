"""bench/trl_arith.py lists every difference between TRL's run and ours beside each result: the ones that follow from
our composed experiment (asynchronous rollouts, the work-saving switches) must appear exactly when the experiment
has them, or a reader compares an asynchronous run to a synchronous one without being told."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import trl_arith  # noqa: E402


def test_the_one_gpu_experiments_async_rollouts_and_work_savings_are_listed():
    found = trl_arith.config_differences(trl_arith.compose_ours([], "smollm2_chat_arith_shared"))
    assert any(d.startswith("rollouts: ours asynchronous (train.max_staleness=1") for d in found)
    assert any(d.startswith("work per step:") for d in found)
    assert any(d.startswith("rollout batches generating at once: ours 2") for d in found)


def test_one_batch_in_flight_lists_no_batches_difference():
    cfg = trl_arith.compose_ours(["train.rollout_batches_in_flight=1"], "smollm2_chat_arith_shared")
    assert not any(d.startswith("rollout batches generating at once") for d in trl_arith.config_differences(cfg))


def test_a_synchronous_run_without_work_savings_lists_neither():
    cfg = trl_arith.compose_ours(["train.max_staleness=0", "train.rollout_batches_in_flight=1", "train.prefix_sharing=false",
                                  "train.skip_zero_advantage=false"], "smollm2_chat_arith_shared")
    assert trl_arith.config_differences(cfg) == []

"""The project's parallel launcher (`hydra/launcher=grpo_parallel`, src/hydra_plugins/grpo_parallel_launcher): a
sweep's jobs several at once, each worker on a GPU group of its own and keeping its vLLM server between its jobs."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from hydra_plugins.grpo_parallel_launcher.grpo_parallel_launcher import layout_gpus, plan_slots
from test_sweep_server import REUSED, SERVER_STARTED, rows, sweep


def server(**values):
    base = {"device": None, "devices": None, "extra_args": [], "external_url": None, "external_urls": None}
    return OmegaConf.create({"server": {**base, **values}})


def test_a_job_layout_takes_the_trainer_gpu_and_its_servers():
    assert layout_gpus(server()) == 1  # shared_vllm, or none/lora with the server beside the trainer
    assert layout_gpus(server(device=1)) == 2  # broadcast: trainer on GPU 0, vLLM on GPU 1
    assert layout_gpus(server(device=1, extra_args=["--tensor-parallel-size", "3"])) == 4
    assert layout_gpus(server(devices=[1, 2])) == 3  # two replicas beside the trainer
    assert layout_gpus(server(external_url="http://h:1")) == 1


def test_workers_get_disjoint_gpu_groups_and_a_sweep_that_cannot_fit_is_refused():
    assert plan_slots(2, 1, []) == [None, None]  # no GPU: the jobs share the CPUs
    assert plan_slots(4, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]  # two at once; the other jobs wait for a group
    assert plan_slots(2, 1, ["4", "6"]) == ["4", "6"]
    with pytest.raises(ValueError, match="needs 2 GPU"):
        plan_slots(2, 2, ["0"])


@pytest.mark.vllm
@pytest.mark.slow
def test_a_sweep_runs_two_jobs_at_once_to_completion_and_leaves_no_process(tmp_path):
    """Three jobs, two at once (two workers, each with its vLLM server: the CPU has no GPUs to place), so one worker
    runs two jobs on one server. Every job completes, step 1 of each (sampled from the initial weights) is the same,
    and no process outlives the sweep."""
    log, sweep_dir = sweep(tmp_path, "train.steps=2", "optimizer.lr=1e-3,2e-3,3e-3", "server.kv_cache_gb=0.25",
                           "hydra/launcher=grpo_parallel", "hydra.launcher.jobs_at_once=2")
    assert "3 jobs, 2 at once" in log
    for job in range(3):
        assert json.loads((sweep_dir / str(job) / "summary.json").read_text())["status"] == "completed", job
        assert len(rows(sweep_dir / str(job))) == 2
    assert rows(sweep_dir / "0")[0] == rows(sweep_dir / "1")[0] == rows(sweep_dir / "2")[0]
    assert log.count(SERVER_STARTED) == 2, log[-4000:]
    assert log.count(REUSED) == 1

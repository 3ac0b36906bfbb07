"""The project's parallel launcher (`hydra/launcher=grpo_parallel`, src/hydra_plugins/grpo_parallel_launcher): a
sweep's jobs several at once, each worker on a GPU group of its own and keeping its vLLM server between its jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from omegaconf import OmegaConf

from conftest import REPO
from hydra_plugins.grpo_parallel_launcher.grpo_parallel_launcher import layout_gpus, plan_slots
from test_sweep_server import REUSED, SERVER_STARTED, rows, sweep
from test_train_e2e import QUICK, assert_clean


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


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_stops_every_running_job_cleanly_and_starts_no_other(tmp_path):
    """SIGINT to the launcher while two jobs train: both stop as Ctrl-C stops a run (summary `interrupted`, their
    servers stopped), the third never starts, and no process is left."""
    sweep_dir = tmp_path / "sweep"
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
    with open(tmp_path / "out.log", "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", *QUICK, "train.steps=200",
                                 "optimizer.lr=1e-3,2e-3,3e-3", "server.kv_cache_gb=0.25",
                                 "hydra/launcher=grpo_parallel", "hydra.launcher.jobs_at_once=2",
                                 f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, env=env, stdout=out, stderr=out)
        try:
            deadline = time.time() + 600
            while not all(rows(sweep_dir / str(job)) if (sweep_dir / str(job) / "metrics.jsonl").exists() else False
                          for job in (0, 1)):
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "out.log").read_text()[-3000:]
                time.sleep(1)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=300) != 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert_clean(marker)
    for job in (0, 1):
        assert json.loads((sweep_dir / str(job) / "summary.json").read_text())["status"] == "interrupted", job
    assert not (sweep_dir / "2" / "summary.json").exists()

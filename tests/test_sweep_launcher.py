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

from conftest import REPO, group_option
from hydra_plugins.grpo_parallel_launcher.lora_server import SharedLoraServer, shares_server
from hydra_plugins.grpo_parallel_launcher.placement import check_fits, job_gpus, place
from hydra_plugins.grpo_parallel_launcher.sweep_jobs import worker_threads
from test_sweep_server import REUSED, SERVER_STARTED, rows, sweep
from test_train_e2e import QUICK, QUICK_SETTINGS, assert_clean, metrics


def server(**values):
    base = {"device": None, "devices": None, "extra_args": [], "external_url": None, "external_urls": None}
    return OmegaConf.create({"server": {**base, **values}})


def test_a_job_needs_the_trainer_gpus_and_its_servers():
    assert job_gpus(server()) == 1  # shared_vllm, or none/lora with the server beside the trainer
    assert job_gpus(server(device=1)) == 2  # broadcast (or none, lora_only): trainer on GPU 0, vLLM on GPU 1
    assert job_gpus(server(device=1, extra_args=["--tensor-parallel-size", "3"])) == 4
    assert job_gpus(server(extra_args=["-tp", "2"])) == 2  # a tensor-parallel server beside the trainer
    assert job_gpus(server(devices=[1, 2])) == 3  # two replicas beside the trainer
    assert job_gpus(server(external_url="http://h:1")) == 1
    assert job_gpus(server(device=2), ranks=2) == 3  # FSDP2 on GPUs 0-1, vLLM on GPU 2
    assert job_gpus(server(), ranks=2) == 2  # FSDP2 on GPUs 0-1, vLLM beside rank 0


def test_a_job_takes_free_gpus_or_an_idle_worker_of_its_size_and_waits_when_none_fit():
    order = ["0", "1", "2", "3"]
    assert place(1, order, [], order) == ("0", [])
    assert place(2, ["1", "3"], [], order) == ("1,3", [])
    # An idle worker of the job's size is taken first: it keeps its vLLM server for a job of the same settings.
    assert place(1, ["3"], ["2"], order) == ("2", [])
    # Not enough free GPUs: idle workers of another size are retired until the job fits.
    assert place(2, ["3"], ["0", "1"], order) == ("0,3", ["0"])
    assert place(3, [], ["0", "1,2"], order) == ("0,1,2", ["0", "1,2"])
    assert place(2, ["3"], [], order) is None  # the others are busy: it waits
    # GPU ids as CUDA_VISIBLE_DEVICES gives them, kept in the host's order.
    assert place(2, ["6", "4"], [], ["4", "6"]) == ("4,6", [])
    check_fits([(0, 2), (1, 4)], order)
    with pytest.raises(ValueError, match="job #1 needs 5 GPU"):
        check_fits([(0, 1), (1, 5)], order)


def lora_job(**values):
    cfg = group_option("server", "cpu")
    job = {"mode": {"_target_": "grpo.sync.lora_hotswap.LoraHotSwapSync"}, "server": cfg, "train": {"resume": None},
           "lora": {"r": 8}, "model": group_option("model", "tiny_qwen2")}
    return OmegaConf.merge(job, values)


def test_lora_jobs_share_a_server_sized_for_the_largest_rank_or_are_refused_clearly(tmp_path):
    jobs = {0: lora_job(), 1: lora_job(lora={"r": 32}), 2: lora_job(server={"max_lora_rank": 32})}
    assert all(shares_server(cfg) for cfg in jobs.values())
    assert not shares_server(lora_job(mode={"_target_": "grpo.sync.lora_restart.LoraRestartSync"}))
    assert not shares_server(lora_job(train={"resume": "outputs/x"}))
    assert not shares_server(lora_job(server={"replicas": 2}))  # its replicas stay its own
    shared = SharedLoraServer(jobs, jobs_at_once=2, sweep_dir=tmp_path)
    assert shared.server_cfg["max_lora_rank"] == 32 and shared.max_loras == 2
    with pytest.raises(ValueError, match="jobs #0 and #1 need different servers"):
        SharedLoraServer({0: lora_job(), 1: lora_job(server={"max_model_len": 256})}, 2, tmp_path)
    with pytest.raises(ValueError, match="--max-loras"):
        SharedLoraServer({0: lora_job(server={"extra_args": ["--max-loras", "4"]})}, 2, tmp_path)


def test_the_workers_share_out_the_hosts_cores():
    assert [worker_threads(n, cores=16) for n in (1, 2, 4, 6, 32)] == [16, 8, 4, 2, 1]
    assert worker_threads(2, cores=2) == 1 and worker_threads(3, cores=1) == 1


@pytest.mark.vllm
@pytest.mark.slow
def test_a_sweep_runs_two_jobs_at_once_to_completion_and_leaves_no_process(tmp_path):
    """Three jobs, two at once (two workers, each with its vLLM server: the CPU has no GPUs to place), so one worker
    runs two jobs on one server. Every job completes, step 1 of each (sampled from the initial weights) is the same,
    and no process outlives the sweep."""
    log, sweep_dir = sweep(tmp_path, "train.steps=2", "optimizer.lr=1e-3,2e-3,3e-3", "server.kv_cache_gb=0.25",
                           "hydra/launcher=grpo_parallel", "hydra.launcher.jobs_at_once=2")
    assert "Launching 3 jobs, at most 2 at once" in log
    for job in range(3):
        assert json.loads((sweep_dir / str(job) / "summary.json").read_text())["status"] == "completed", job
        assert len(rows(sweep_dir / str(job))) == 2
    assert rows(sweep_dir / "0")[0] == rows(sweep_dir / "1")[0] == rows(sweep_dir / "2")[0]
    assert log.count(SERVER_STARTED) == 2, log[-4000:]
    assert log.count(REUSED) == 1
    # Each worker's trainer sized its thread pool to its share of the cores, not to all of them.
    threads = os.environ.get("OMP_NUM_THREADS") or str(worker_threads(2))
    for job in range(3):
        assert f"trainer torch threads: {threads}\n" in (sweep_dir / str(job) / "train.log").read_text(), job


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("base", [QUICK, [*QUICK_SETTINGS, "experiment=cpu_tiny_lora_only"]], ids=["none", "lora_only"])
def test_ctrl_c_stops_every_running_job_cleanly_and_starts_no_other(tmp_path, base):
    """SIGINT to the launcher while two jobs train: both stop as Ctrl-C stops a run (summary `interrupted`, their
    servers stopped; lora_only: the shared server the launcher started), the third never starts, and no process is
    left."""
    sweep_dir = tmp_path / "sweep"
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
    with open(tmp_path / "out.log", "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", *base, "train.steps=200",
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


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_jobs_train_side_by_side_on_one_server_and_a_job_whose_worker_dies_is_recorded(tmp_path):
    """Three mode=lora_only jobs, two at once, on ONE vLLM server the launcher starts: each job's adapters are loaded
    under its own name (job<N>-v<version>) and each rollout reports the job's own version. The worker of job 0 is
    killed after its first step: job 0 is recorded as failed (summary.json, NaN objective), the sweep goes on, the
    other jobs complete, and no process is left."""
    import re

    sweep_dir = tmp_path / "sweep"
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
    out_log = tmp_path / "out.log"
    with open(out_log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", *QUICK_SETTINGS,
                                 "experiment=cpu_tiny_lora_only", "train.steps=3", "optimizer.lr=5e-3,1e-2,2e-2",
                                 "server.kv_cache_gb=0.25", "hydra/launcher=grpo_parallel",
                                 "hydra.launcher.jobs_at_once=2", f"hydra.sweep.dir={sweep_dir}"],
                                cwd=REPO, env=env, stdout=out, stderr=out)
        try:
            deadline = time.time() + 600
            while not ((sweep_dir / "0" / "metrics.jsonl").exists() and rows(sweep_dir / "0")):
                assert proc.poll() is None and time.time() < deadline, out_log.read_text()[-3000:]
                time.sleep(0.5)
            worker0 = int(re.search(r"worker 0 \(pid (\d+)\)", out_log.read_text()).group(1))
            os.kill(worker0, signal.SIGKILL)
            assert proc.wait(timeout=600) == 0, out_log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert_clean(marker)
    log = out_log.read_text()
    assert log.count(SERVER_STARTED) == 1, log[-4000:]  # the shared server alone
    assert "job #0: its worker" in log and "recorded as failed" in log
    assert json.loads((sweep_dir / "0" / "summary.json").read_text())["status"] == "failed"
    for job in (1, 2):
        assert json.loads((sweep_dir / str(job) / "summary.json").read_text())["status"] == "completed", job
        trained = [r for r in metrics(sweep_dir / str(job)) if "loss" in r]
        assert [r["sync/served_version"] for r in trained] == [1.0, 2.0, 3.0]
    server_log = (sweep_dir / "lora_server" / "vllm.log").read_text()
    assert all(f"job{job}-v3" in server_log for job in (1, 2)) and "job0-v1" in server_log
    assert rows(sweep_dir / "1")[0][:2] == rows(sweep_dir / "2")[0][:2]  # step 1: both from the base model
    assert "sweep done: 3 jobs" in log


@pytest.mark.vllm
@pytest.mark.slow
def test_a_shared_lora_server_that_does_not_start_fails_its_jobs_and_the_sweep_ends_cleanly(tmp_path):
    """The launcher's LoRA server refuses its command line: its jobs are recorded as failed (NaN objectives), the sweep
    ends with exit 0 and its last lines, and no process is left."""
    log, _ = sweep(tmp_path, "experiment=cpu_tiny_lora_only", "optimizer.lr=1e-3,2e-3",
                   "server.extra_args=[--no-such-flag]", "hydra/launcher=grpo_parallel", "hydra.launcher.jobs_at_once=2",
                   base=QUICK_SETTINGS)
    assert "the shared LoRA server did not start" in log and "its 2 job(s) are recorded as failed" in log
    assert "sweep done: 0 jobs" in log and "worker 0" not in log

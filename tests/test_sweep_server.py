"""One vLLM server per sweep (grpo.serving.kept, server.reuse_across_jobs): the jobs of a multirun that need the same
server take over the one the job before kept, its weights reset to the initial model, and each job trains as it
would alone; a kept server that died or serves other settings is replaced; nothing outlives the sweep."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import REPO
from test_train_e2e import QUICK, QUICK_SETTINGS, assert_clean, metrics, run_train

pytestmark = pytest.mark.vllm

REUSED = "reusing the vLLM server of the previous job (weights reset to the initial model)"
SERVER_STARTED = "vLLM ready at"


def sweep(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None,
          base: tuple[str, ...] | list[str] = QUICK) -> tuple[str, Path]:
    """A multirun of `base` (the quick bare config) into tmp_path/sweep; its output, checked to have succeeded,
    and the sweep dir. Every process it started must be gone once it exits."""
    sweep_dir = tmp_path / "sweep"
    out, marker = run_train("-m", *base, *overrides, f"hydra.sweep.dir={sweep_dir}", timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_clean(marker)  # the kept server included: the sweep's end stopped it
    return out.stdout + out.stderr, sweep_dir


def rows(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, loss, reward/mean) of each trained step."""
    return [(r["step"], r["loss"], r["reward/mean"]) for r in metrics(run_dir) if "loss" in r]


def test_a_sweep_starts_vllm_once_and_each_job_samples_from_the_initial_weights(tmp_path):
    """Two jobs, two steps each, one vLLM start. Step 1 of every job samples from the initial weights and computes its
    loss there (the learning rate acts from step 2 on): job 1's step 1 equals job 0's only if the server it took over
    was reset to the initial model (without the reset it samples from job 0's trained weights)."""
    log, sweep_dir = sweep(tmp_path, "train.steps=2", "optimizer.lr=1e-3,3e-3")
    assert log.count(SERVER_STARTED) == 1, log[-4000:]
    assert log.count(REUSED) == 1
    first, second = rows(sweep_dir / "0"), rows(sweep_dir / "1")
    assert len(first) == len(second) == 2
    assert second[0] == first[0]
    assert second[1] != first[1]  # the jobs differ where their learning rates do: nothing else carried over
    # The job that took the server over reads its log and pid file in its own run dir (a link to the first job's log).
    assert (sweep_dir / "1" / "logs" / "vllm.log").resolve() == (sweep_dir / "0" / "logs" / "vllm.log").resolve()
    assert not (sweep_dir / "1" / "logs" / "vllm.pid").exists()  # stopped at the sweep's end


def assert_second_job_restarts_from_the_initial_model(log: str, sweep_dir: Path) -> None:
    """One vLLM start for the 2-job sweep, the second job reusing it: its first step equals the first job's (both
    sample from the initial model), its second differs (another learning rate)."""
    assert log.count(SERVER_STARTED) == 1, log[-4000:]
    assert log.count(REUSED) == 1
    first, second = rows(sweep_dir / "0"), rows(sweep_dir / "1")
    assert second[0] == first[0]
    assert second[1] != first[1]


@pytest.mark.slow
def test_a_lora_only_sweep_resets_the_adapters_of_the_job_before(tmp_path):
    """mode=lora_only: the job that takes the server over unloads the adapters the job before loaded, so its own load
    under the same names (policy-v1, ...: vLLM refuses a name already loaded) and it trains as job 0 did."""
    log, sweep_dir = sweep(tmp_path, "experiment=cpu_tiny_lora_only", "train.steps=2", "optimizer.lr=5e-3,1e-2",
                           base=QUICK_SETTINGS)
    assert_second_job_restarts_from_the_initial_model(log, sweep_dir)


@pytest.mark.slow
def test_a_shared_vllm_sweep_on_the_cpu_resets_the_server_memory_the_job_before_trained(tmp_path):
    """mode=shared_vllm on the CPU: job 0 trains the server's own tensors in place; the job that takes the server
    over reloads the initial weights into them and maps them anew, so its step 1 samples from the initial model."""
    log, sweep_dir = sweep(tmp_path, "mode=shared_vllm", "train.steps=2", "optimizer.lr=1e-3,3e-3")
    assert_second_job_restarts_from_the_initial_model(log, sweep_dir)


@pytest.mark.slow
def test_each_job_of_a_sweep_on_one_server_trains_as_it_does_alone(tmp_path):
    """A 3-job sweep over optimizer.lr starts vLLM once, and each job's loss and mean reward per step equal those of
    the same job run alone (its own server), to the digit."""
    lrs = ["1e-3", "2e-3", "3e-3"]
    log, sweep_dir = sweep(tmp_path, "train.steps=3", f"optimizer.lr={','.join(lrs)}")
    assert log.count(SERVER_STARTED) == 1, log[-4000:]
    assert log.count(REUSED) == 2
    for i, lr in enumerate(lrs):
        alone = tmp_path / f"alone-{i}"
        out, _ = run_train(*QUICK, "train.steps=3", f"optimizer.lr={lr}", f"hydra.run.dir={alone}")
        assert out.returncode == 0, out.stderr[-3000:]
        assert rows(sweep_dir / str(i)) == rows(alone), f"job {i} (optimizer.lr={lr})"
        assert len(rows(alone)) == 3


@pytest.mark.slow
def test_a_kept_server_that_died_or_serves_other_settings_is_replaced(tmp_path):
    """Four jobs: the server job 0 kept is killed before job 1 (a test callback), so job 1 starts a new one; job 2
    needs another server (server.max_model_len), so job 1's is stopped and job 2 starts its own; job 3 takes it over.
    Every job completes; three start-ups, one reuse."""
    hooks = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    log, sweep_dir = sweep(tmp_path, "train.steps=1", "server.max_model_len=1024,1024,512,512",
                           "+hydra.callbacks.kill_kept_server._target_=sweep_hooks.KillServerAfterJob",
                           "+hydra.callbacks.kill_kept_server.job=0", env=hooks)
    assert "killed the kept vLLM server" in log
    assert "the vLLM server kept from the previous job no longer answers" in log
    assert "this job needs another server" in log
    assert log.count(SERVER_STARTED) == 3, log[-4000:]
    assert log.count(REUSED) == 1
    for job in range(4):
        assert len(rows(sweep_dir / str(job))) == 1, f"job {job}"

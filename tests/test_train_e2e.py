"""End to end: `python train.py` with the real vLLM CPU engine on the tiny model, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, attach, free_port
from grpo.conf import EXPERIMENTS_DIR

pytestmark = pytest.mark.vllm

# Small and quick: 4 prompts x 4 completions per step.
# eval=off: these runs test training, resume and teardown; held-out eval (its step-0 row) is tested in
# tests/test_evaluation.py.
# server.enforce_eager=true: vLLM starts without torch.compile, ~12 s less per start (~25 s on a new weights directory,
# e.g. a resume's checkpoint); the compiled start is what tests/test_default_run.py runs (the default config).
# ~experiment: the bare config (random tiny Qwen2, digits task), not the default job's experiment (arith_quick,
# which builds the warm-start model); tests that pick their own experiment take QUICK_SETTINGS.
QUICK_SETTINGS = [
    "data.prompts_per_step=4", "data.group_size=4", "train.micro_batch_size=8", "train.grad_accum=2",
    "logging.progress_bar=false", "eval=off", "server.enforce_eager=true",
]
QUICK = ["~experiment", *QUICK_SETTINGS]
CPU_EXPERIMENTS = sorted(p.stem for p in EXPERIMENTS_DIR.glob("cpu_*.yaml"))
REQUIRED_KEYS = {"step", "loss", "reward/mean", "grpo/mean_ratio", "grpo/clipped_fraction", "sync/seconds",
                 "time/step_seconds", "tokens/trained"}


def processes_with_marker(marker: str) -> list[int]:
    """Pids whose environment carries `marker` (every process a run started inherits it)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def run_train(*overrides: str, timeout: float = 420, env: dict[str, str] | None = None
              ) -> tuple[subprocess.CompletedProcess, str]:
    """Run train.py in a subprocess tagged with a marker (`env` added to its environment); returns the result and
    the marker."""
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, **(env or {}), GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], capture_output=True, text=True,
                         cwd=REPO, timeout=timeout, env=env)
    return out, marker


def assert_clean(marker: str) -> None:
    """No process the run started outlives it."""
    deadline = time.time() + 10
    while processes_with_marker(marker) and time.time() < deadline:
        time.sleep(0.5)
    assert processes_with_marker(marker) == []


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_default_job_trains_checkpoints_resumes_and_its_saved_config_reproduces_it(tmp_path, train_server,
                                                                                    tiny_qwen2_dir):
    run_dir = tmp_path / "run"
    port = free_port()
    out, marker = run_train(*QUICK, "train.steps=2", "train.checkpoint_every=1", f"server.port={port}",
                            f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert REQUIRED_KEYS <= set(rows[0])
    assert rows[0]["sync/seconds"] > 0  # mode=none pushed new weights to vLLM
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "provenance.json").exists()
    complete = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    assert complete == ["step_000001", "step_000002"]
    # The first session's record, as it was before the resume below (the resume moves it into sessions/01/).
    first_config = (run_dir / ".hydra" / "config.yaml").read_text()
    first_argv = json.loads((run_dir / "provenance.json").read_text())["argv"]

    # Resume in place: steps 3 and 4 follow, metrics keep steps 1-2. This run and the rerun below attach to the
    # session's server (a vLLM start-up each saved; the first run above started and stopped its own).
    external, env = attach(train_server, tiny_qwen2_dir)
    out, marker = run_train(*QUICK, "train.steps=4", "train.checkpoint_every=1", external,
                            f"hydra.run.dir={run_dir}", f"train.resume={run_dir}", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # Each session's config and command stay with the run: the first in sessions/01/, the resume's at the top.
    saved = run_dir / "sessions" / "01" / ".hydra"
    assert (saved / "config.yaml").read_text() == first_config
    assert json.loads((run_dir / "sessions" / "01" / "provenance.json").read_text())["argv"] == first_argv
    assert f"train.resume={run_dir}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert f"train.resume={run_dir}" in " ".join(json.loads((run_dir / "provenance.json").read_text())["argv"])

    # `--config-path <run>/sessions/01/.hydra --config-name config` reruns the first session: the same first step.
    again = tmp_path / "again"
    external, env = attach(train_server, tiny_qwen2_dir)
    out, _ = run_train("--config-path", str(saved), "--config-name", "config", external, f"hydra.run.dir={again}",
                       env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = rows[0], metrics(again)[0]
    assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-6)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


@pytest.mark.slow  # 40-105 s of the CI suite's 25-minute budget: run with `pytest -m slow`
def test_multirun_of_the_cpu_experiments_with_report_and_clean_teardown(tmp_path):
    """One sweep over the CPU experiments (one step each): every mode trains, syncs and reports; vLLM is torn down
    between jobs (each job starts its own on the same port) and after the last."""
    port = free_port()
    sweep = tmp_path / "sweep"
    out, marker = run_train("-m", f"experiment={','.join(CPU_EXPERIMENTS)}", *QUICK_SETTINGS, "train.steps=1",
                            "loss.clip_eps=0.3", f"server.port={port}", f"hydra.sweep.dir={sweep}", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    from grpo.report import report

    table, rows = report(sweep)
    assert len(rows) == len(CPU_EXPERIMENTS) == 3
    assert {r["status"] for r in rows} == {"completed"}
    assert all(r["steps"] == 1 for r in rows)
    jobs = {}
    for r in rows:
        (name,) = [n for n in CPU_EXPERIMENTS if f"experiment={n}" in r["overrides"]]
        assert "loss.clip_eps=0.3" in r["overrides"]
        jobs[name] = sweep / r["job"]
    assert sorted(jobs) == CPU_EXPERIMENTS
    for name, job in jobs.items():
        (row,) = metrics(job)
        assert REQUIRED_KEYS <= set(row), name
        assert row["sync/seconds"] > 0, name
        # The experiment picked its mode (cpu_tiny_<mode>).
        assert OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.runtime.choices["mode"] == name.removeprefix("cpu_tiny_")
        # server.launch_early: each job's vLLM started before its tokenizer loaded; the job waited only for the rest.
        clock = json.loads((job / "summary.json").read_text())["wall_clock"]
        assert clock["startup_at"]["server_launched_seconds"] < clock["startup_at"]["server_ready_seconds"], name
        # The start-up's moments in the order the build reaches them, all before the loop's start.
        moments = [clock["startup_at"][f"{m}_seconds"] for m in ("server_ready", "model_loaded", "optimizer_built",
                                                                 "data_ready")]
        assert moments == sorted(moments) and moments[-1] <= clock["startup_seconds"], (name, moments)
        assert clock["startup"]["server_wait_seconds"] > 0 and "server_start_seconds" not in clock["startup"], name
    assert "last10_reward_mean" in table and (sweep / "rewards.png").exists()
    # The port of the last job's server is free again.
    import socket

    with socket.socket() as s:
        # SO_REUSEADDR as every server sets it: closed connections in TIME_WAIT don't make a port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))

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

from conftest import REPO, free_port

pytestmark = pytest.mark.vllm

# Small and quick: 4 prompts x 4 completions per step.
# eval=off: these runs test training, resume and teardown; held-out eval (its step-0 row) is tested in
# tests/test_evaluation.py.
QUICK = [
    "data.prompts_per_step=4", "data.group_size=4", "train.micro_batch_size=8", "train.grad_accum=2",
    "logging.progress_bar=false", "eval=off",
]
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


def run_train(*overrides: str, timeout: float = 420) -> tuple[subprocess.CompletedProcess, str]:
    """Run train.py in a subprocess tagged with a marker; returns the result and the marker."""
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
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


def test_default_job_trains_checkpoints_and_resumes(tmp_path):
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

    # Resume in place: steps 3 and 4 follow, metrics keep steps 1-2.
    out, marker = run_train(*QUICK, "train.steps=4", "train.checkpoint_every=1", f"server.port={port}",
                            f"hydra.run.dir={run_dir}", f"train.resume={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "experiments").glob("cpu_*.yaml")))
def test_cpu_experiments_run_one_step(tmp_path, name):
    out, marker = run_train(f"experiment={name}", *QUICK, "train.steps=1", f"server.port={free_port()}",
                            f"hydra.run.dir={tmp_path}/run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    (row,) = metrics(tmp_path / "run")
    assert REQUIRED_KEYS <= set(row)
    assert row["sync/seconds"] > 0


def test_saved_config_reproduces_first_step(tmp_path):
    port = free_port()
    first = tmp_path / "first"
    out, _ = run_train(*QUICK, "train.steps=1", f"server.port={port}", f"hydra.run.dir={first}")
    assert out.returncode == 0, out.stderr[-3000:]
    again = tmp_path / "again"
    out, _ = run_train("--config-path", str(first / ".hydra"), "--config-name", "config",
                       f"hydra.run.dir={again}")
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = metrics(first)[0], metrics(again)[0]
    assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-6)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_multirun_2x2_with_report_and_clean_teardown(tmp_path):
    port = free_port()
    sweep = tmp_path / "sweep"
    out, marker = run_train("-m", *QUICK, "train.steps=2", f"server.port={port}", f"hydra.sweep.dir={sweep}",
                            "loss.clip_eps=0.1,0.3", "optimizer.lr=1e-3,3e-3", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    from grpo.report import report

    table, rows = report(sweep)
    assert len(rows) == 4
    assert {r["status"] for r in rows} == {"completed"}
    assert all(r["steps"] == 2 for r in rows)
    overrides = {r["overrides"] for r in rows}
    assert len(overrides) == 4 and all("loss.clip_eps=" in o and "optimizer.lr=" in o for o in overrides)
    assert "last10_reward_mean" in table and (sweep / "rewards.png").exists()
    # The port of the last job's server is free again.
    import socket

    with socket.socket() as s:
        # SO_REUSEADDR as every server sets it: closed connections in TIME_WAIT don't make a port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))

"""bench/gpu/pyspy_run.py wraps a plan's training run: the run must end as it would without the wrapper (its return
code, nothing cut short) whether or not py-spy can profile it, and the JSON beside it must say what happened."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import pyspy_run  # noqa: E402

# A stand-in for train.py: writes `rows` metrics rows, keeps running `seconds`, exits with `code`.
FAKE_RUN = """
import sys, time
from pathlib import Path
metrics, rows, seconds, code = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
for i in range(rows):
    with metrics.open("a") as f:
        f.write('{"step": %d}\\n' % i)
t_end = time.time() + seconds
while time.time() < t_end:
    sum(range(10000))
sys.exit(code)
"""


def run(tmp_path: Path, rows: int, seconds: float, code: int, after_rows: int, spy_seconds: float = 1.0):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--metrics", str(metrics), "--after-rows", str(after_rows), "--seconds", str(spy_seconds),
            "--out", str(tmp_path / "job"), "--", sys.executable, "-c", FAKE_RUN, str(metrics), str(rows),
            str(seconds), str(code)]  # fmt: skip
    rc = pyspy_run.main(argv)
    return rc, json.loads((tmp_path / "job.pyspy.json").read_text())


def test_without_py_spy_the_run_ends_with_its_own_code_and_the_reason_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)  # what start_recording looks up
    rc, result = run(tmp_path, rows=3, seconds=2.5, code=3, after_rows=2)
    assert rc == 3
    assert "py-spy is not installed" in result["error"]


def test_a_run_that_ends_before_its_rows_is_not_profiled(tmp_path):
    rc, result = run(tmp_path, rows=1, seconds=0.2, code=0, after_rows=50)
    assert rc == 0
    assert "ended before its metrics had 50 rows" in result["error"]
    assert not (tmp_path / "job.pyspy.txt").exists()


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_with_py_spy_the_steady_state_is_sampled_per_process(tmp_path):
    rc, result = run(tmp_path, rows=2, seconds=4.0, code=0, after_rows=2)
    assert rc == 0
    if "error" in result:  # a host that forbids ptrace: the run still ended normally
        pytest.skip(result["error"])
    assert result["after_rows"] >= 2 and result["processes"]
    assert sum(p["samples"] for p in result["processes"].values()) > 0
    assert 1.0 <= result["window_s"] < 3.0  # the wall-clock window asked for, however far py-spy fell behind


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_a_run_that_ends_inside_the_window_ends_the_recording_with_it(tmp_path):
    rc, result = run(tmp_path, rows=2, seconds=1.5, code=0, after_rows=2, spy_seconds=30.0)
    assert rc == 0
    if "error" in result:
        pytest.skip(result["error"])
    assert result["window_s"] < 10.0 and result["processes"]

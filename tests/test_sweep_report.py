"""The end of a sweep (`python train.py -m ...`) names the sweep dir and the command that compares its jobs: each job's
own last line names only its job dir, and Hydra says nothing when the sweep ends (a newcomer had the last job's
`python -m grpo.report <sweep>/2`, a one-row table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from grpo.conf import CONFIG_DIR
from grpo.config import register_configs

REPO = Path(__file__).resolve().parents[1]
register_configs()


def job(sweep: Path, num: int, summary: dict, steps: int) -> None:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(f"- train.seed={num}\n")
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n"
                                             for s in range(1, steps + 1)))


def test_the_callbacks_of_the_composed_config_end_a_sweep_with_its_dir_and_the_report_command(tmp_path, capsys):
    sweep = tmp_path / "multirun" / "12-00-00"
    job(sweep, 0, {"status": "completed"}, 2)
    job(sweep, 1, {"status": "completed"}, 2)
    job(sweep, 2, {"status": "skipped", "error": "ConfigError: x"}, 0)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
    callbacks = [instantiate(c) for c in cfg.hydra.callbacks.values()]
    for callback in callbacks:  # what Hydra does after the last job of a multirun
        callback.on_multirun_end(config=cfg)
    out = capsys.readouterr().out
    assert f"sweep done: 3 jobs (2 completed, 1 skipped) in {sweep}" in out
    assert f"compare them: python -m grpo.report {sweep}" in out


def wall_clock(startup: float, loop: float, teardown: float) -> dict:
    """summary.json's `wall_clock` of a job whose start-up, training loop and teardown took these seconds."""
    from grpo.trainer.wall_clock import WallClock

    clock = WallClock(origin=1000.0)
    clock.loop_start, clock.loop_end = 1000.0 + startup, 1000.0 + startup + loop
    return clock.summary(now=1000.0 + startup + loop + teardown)


def test_the_last_line_of_a_sweep_gives_its_wall_clock_and_the_jobs_training_summed(tmp_path, capsys):
    """The sweep's wall clock (from its start) and its jobs' training loops summed (start-up and teardown left out):
    what a sweep spent beyond training shows at a glance."""
    sweep = tmp_path / "multirun" / "12-00-00"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
    callbacks = [instantiate(c) for c in cfg.hydra.callbacks.values()]
    for callback in callbacks:  # what Hydra does before the first job, then the jobs, then after the last
        callback.on_multirun_start(config=cfg)
    job(sweep, 0, {"status": "completed", "wall_clock": wall_clock(40.0, 100.0, 2.0)}, 2)
    job(sweep, 1, {"status": "failed", "wall_clock": wall_clock(3.0, 20.5, 1.0)}, 1)
    job(sweep, 2, {"status": "skipped", "error": "ConfigError: x"}, 0)
    for callback in callbacks:
        callback.on_multirun_end(config=cfg)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("  wall clock 0 s; training 120 s summed over the 2 jobs that ran"), last


def test_a_sweep_into_a_dir_whose_jobs_ran_stops_before_hydra_rewrites_their_records(tmp_path):
    """A sweep given the same hydra.sweep.dir twice: each job used to be skipped by train.py's own check, but only
    after Hydra had written that job's .hydra/ over the earlier run's config and overrides."""
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    job(sweep, 0, {"status": "completed"}, 2)
    (sweep / "1" / ".hydra").mkdir(parents=True)  # a job that never trained: holds no run
    record = sweep / "0" / ".hydra" / "overrides.yaml"
    before = record.read_text()
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "~experiment", "train.steps=1,2",
                          f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"ConfigError: sweep dir {sweep} already holds runs (jobs 0)" in out.stderr
    assert "hydra.sweep.dir" in out.stderr and "Traceback" not in out.stderr
    assert record.read_text() == before  # the earlier job's record is untouched
    assert not (sweep / "multirun.yaml").exists()


def test_a_sweep_into_a_fresh_or_never_trained_dir_is_let_through(tmp_path):
    from grpo.config.run_dir import check_sweep_dir_unused

    check_sweep_dir_unused(tmp_path / "does-not-exist")
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / "metrics.jsonl").write_text("")  # started, no row written
    check_sweep_dir_unused(tmp_path)


@pytest.mark.slow  # 20-60 s of the CI suite's 25-minute budget: run with `pytest -m slow`
@pytest.mark.vllm  # its job starts a vLLM server
def test_a_sweep_job_whose_data_source_dies_after_training_is_failed_not_skipped(tmp_path):
    """A data source lost mid-run (run-api killed after some steps) was handled as a config problem: the job was
    logged as skipped, wrote no summary.json, and the sweep's end line and grpo.report called it running. It trained
    steps, so it failed; a source that fails before any step still makes the job skipped."""
    import os
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "~experiment", "train.steps=4",
                          "data._target_=failing_source.GoneAfterTwoBatches", "eval=off", "logging.plot=false",
                          "logging.progress_bar=false", f"hydra.sweep.dir={sweep}"],
                         capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-3000:]  # the sweep goes on past a failed job
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["status"] == "failed" and "DataSourceError" in summary["error"], summary
    rows = [json.loads(line) for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "1 failed" in out.stdout + out.stderr

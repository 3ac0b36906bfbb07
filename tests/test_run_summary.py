"""summary.json's reward figures: named for what they are, over every step of the run dir (issue 22.1)."""

from __future__ import annotations

import json
import os
import re

import pytest

from grpo.conf import CONFIG_DIR
from grpo.run_summary import RunSummary


def test_first10_and_last10_reward_means_cover_every_step_of_a_resumed_run(tmp_path):
    # Steps 1-20 in metrics.jsonl (a run resumed in place at step 10); this session returned steps 11-20 only.
    rewards = [0.05 * s for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": r}) + "\n"
                                                    for s, r in zip(range(1, 21), rewards)))
    objective = RunSummary(tmp_path).finish(rewards[10:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_run"] == 20
    assert summary["first10_reward_mean"] == sum(rewards[:10]) / 10
    assert summary["last10_reward_mean"] == objective == sum(rewards[10:]) / 10
    assert "final_reward" not in summary and "first_reward" not in summary


def test_a_run_with_only_its_first_evaluation_does_not_read_as_no_change(tmp_path):
    """eval.at_end=false and no eval inside the run: the line said "held-out accuracy 0.382 -> 0.382"."""
    from grpo.run_summary import done_message

    rows = [{"step": 0, "eval/accuracy": 0.382}, {"step": 1, "reward/mean": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    RunSummary(tmp_path).finish([0.5])
    assert "held-out accuracy 0.382 (one evaluation, at step 0); run dir: " in done_message(tmp_path)


def test_steps_run_counts_optimizer_steps_when_a_rollout_batch_has_several(tmp_path):
    """train.ppo_epochs x train.mini_batches = 4: a 4-step run has one rollout batch (its reward on the batch's first
    row). summary.json and the done line said "1 steps" while grpo.report said 4."""
    from grpo.run_summary import done_message

    rows = [{"step": 1, "reward/mean": 0.5, "loss": 0.1}, {"step": 2, "loss": 0.2}, {"step": 3, "loss": 0.1},
            {"step": 4, "loss": 0.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    RunSummary(tmp_path).finish([0.5])  # a torn last line (a crash mid-write) is left out, not a crash here
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_run"] == 4 and summary["rollout_batches"] == 1
    assert done_message(tmp_path).startswith("run completed: 4 steps; reward 0.500 (mean of its 1 rollout batch)")


def test_without_metrics_the_session_rewards_are_used_and_a_short_run_has_disjoint_windows(tmp_path):
    RunSummary(tmp_path).finish([0.1, 0.3])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["first10_reward_mean"], summary["last10_reward_mean"], summary["reward_window"]) == (0.1, 0.3, 1)
    assert summary["best_reward"] == 0.3 and summary["status"] == "completed"


def test_a_skipped_job_keeps_the_summary_of_a_run_its_dir_holds(tmp_path):
    """A sweep job refused because its dir holds an earlier run must not replace that run's summary.json."""
    RunSummary(tmp_path).skip(ValueError("bad"))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "skipped"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    RunSummary(tmp_path).finish([0.5])
    RunSummary(tmp_path).skip(ValueError("bad"))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing", "is not a directory: give a run dir or a sweep (multirun) dir"),
    (lambda d: d, "no runs in"),
])
def test_report_of_a_dir_without_runs_is_a_one_line_error(tmp_path, capsys, make, needle):
    """Before: a FileNotFoundError traceback, or an empty table with report.json and rewards.png written anyway."""
    from grpo.report import main

    with pytest.raises(SystemExit) as e:
        main([str(make(tmp_path))])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_a_completed_run_ends_with_a_line_saying_how_it_went_and_where_its_outputs_are(tmp_path):
    """Before, a run ended with its progress bar: the run dir was named only among the start-up lines."""
    from grpo.run_summary import done_message

    rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5},
            {"step": 2, "reward/mean": 0.7, "eval/accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    RunSummary(tmp_path).finish([0.5, 0.7])
    assert done_message(tmp_path) == (
        "run completed: 2 steps; reward 0.500 -> 0.700 (mean of the first and last 1 rollout batch of 2); held-out "
        f"accuracy 0.250 -> 0.500; run dir: {tmp_path} (summary: python -m grpo.report {tmp_path})")  # one line
    longer = tmp_path / "longer"
    longer.mkdir()
    RunSummary(longer).finish([0.1] * 20 + [0.9] * 2)  # 22 batches: windows of 10
    assert "; reward 0.100 -> 0.260 (mean of the first and last 10 rollout batches of 22)" in done_message(longer)


def test_the_first_and_last_reward_windows_never_overlap(tmp_path):
    """sweep=clip_eps: 60 steps of 4 updates are 15 rollout batches, whose 'first and last 10' shared 5 batches."""
    from grpo.run_summary import done_message, reward_window

    assert [reward_window(n) for n in (1, 2, 3, 15, 19, 20, 60)] == [1, 1, 1, 7, 9, 10, 10]
    rewards = [0.0] * 8 + [1.0] * 7  # 15 batches: learning at batch 9
    RunSummary(tmp_path).finish(rewards)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["first10_reward_mean"], summary["last10_reward_mean"], summary["reward_window"]) == (0.0, 1.0, 7)
    assert "reward 0.000 -> 1.000 (mean of the first and last 7 rollout batches of 15)" in done_message(tmp_path)


def test_resuming_a_run_with_another_model_or_data_is_refused_naming_the_runs_command(tmp_path):
    """Before, `python train.py train.resume=<a '~experiment' run>` (the README's resume line, without the run's
    overrides) continued the tiny digits run on the default job's model name and arithmetic data, silently."""
    from omegaconf import OmegaConf

    from grpo.config_values import ConfigError
    from grpo.run_records import check_resume_identity, record_provenance

    def cfg(offline: str, data: str):
        return OmegaConf.create({"train": {"resume": str(tmp_path)}, "model": {
            "name": offline, "offline": offline, "num_layers": 4}, "mode": {"_target_": "grpo.sync.M"},
            "data": {"_target_": "grpo.pipeline.local.LocalRolloutPipeline", "task": {"_target_": data}}})

    tiny = cfg("tiny-qwen2", "grpo.tasks.prompts.DigitsTask")
    record_provenance(tmp_path, tiny)
    check_resume_identity(tiny)  # the same run's settings: fine
    with pytest.raises(ConfigError) as e:
        check_resume_identity(cfg("warm-arith", "grpo.tasks.arithmetic.ArithmeticTask"))
    assert str(e.value).startswith(
        f"train.resume={tmp_path} was trained with model.name=tiny-qwen2, model.offline=tiny-qwen2, "
        "data.task._target_=grpo.tasks.prompts.DigitsTask, but this command composes model.name=warm-arith, "
        "model.offline=warm-arith, data.task._target_=grpo.tasks.arithmetic.ArithmeticTask; resume with the run's "
        "own settings: ")
    assert str(e.value).endswith(f" train.resume={tmp_path}")
    # A run that was itself resumed: its command's own train.resume gives way to this one, not beside it.
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    provenance["argv"] = ["train.py", "~experiment", "train.resume=outputs/older"]
    (tmp_path / "provenance.json").write_text(json.dumps(provenance))
    with pytest.raises(ConfigError) as e:
        check_resume_identity(cfg("warm-arith", "grpo.tasks.arithmetic.ArithmeticTask"))
    assert str(e.value).endswith(f"own settings: python train.py '~experiment' train.resume={tmp_path}")


@pytest.mark.parametrize("override, named", [
    ("optimizer=adafactor", "optimizer._target_=torch.optim.AdamW"),
    ("layers=first50", "layers.indices=all"),
    ("lora.r=8", "lora.r=16"),
], ids=["optimizer", "layers", "lora_rank"])
def test_resuming_with_another_optimizer_layers_or_lora_shape_is_refused_before_the_server_starts(
        tmp_path, override, named):
    """Before: a resume with optimizer=adafactor failed at its first optimizer step (KeyError: 'beta1'), one with
    layers=first50 in torch's load_state_dict ('a parameter group that doesn't match the size'), both after vLLM's
    start-up, with a traceback naming no setting."""
    from hydra import compose, initialize_config_dir

    from grpo.config import register_configs
    from grpo.config_values import ConfigError
    from grpo.run_records import check_resume_identity, record_provenance

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        same = compose("train", overrides=["~experiment", "mode=lora_only", f"train.resume={tmp_path}"])
        resume = compose("train", overrides=["~experiment", "mode=lora_only", f"train.resume={tmp_path}", override])
    record_provenance(tmp_path, same)  # the run's own record (lora.target_modules, a list, in its JSON)
    check_resume_identity(same)
    with pytest.raises(ConfigError, match=f"was trained with {re.escape(named)}, but this command composes"):
        check_resume_identity(resume)


def test_a_second_trainer_in_a_run_dir_in_use_stops_naming_the_holder(tmp_path):
    """A resume command run twice (or a requeued job) put two trainers in one run dir: both 'completed', the second
    replaced metrics.jsonl under the first. The run dir's lock stops the second before Hydra writes anything."""
    import subprocess
    import sys
    from pathlib import Path

    from grpo.run_records import lock_run_dir, unlock_run_dir

    run = tmp_path / "run"
    lock_run_dir(run)  # this process is the running trainer
    try:
        out = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), "~experiment",
                              f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr[-2000:]
        assert f"ConfigError: run dir {run} is in use by a running trainer (pid {os.getpid()})" in out.stderr
        assert not (run / ".hydra").exists() and not (run / "metrics.jsonl").exists()
    finally:
        unlock_run_dir()
    lock_run_dir(run)  # free again: taken at once
    unlock_run_dir()


def test_a_summary_that_cannot_be_written_is_logged_and_never_left_half_written(tmp_path, caplog):
    """summary.json is written inside the handling of a failed run: a write error there replaced the run's own
    error. It is now logged; and the file is replaced whole (a temporary file renamed over it)."""
    import logging

    summary = RunSummary(tmp_path)
    summary.finish([0.5])
    first = (tmp_path / "summary.json").read_text()
    (tmp_path / ".summary.json.tmp").mkdir()  # the temporary file cannot be written
    with caplog.at_level(logging.ERROR, logger="grpo.run_summary"):
        summary.fail(RuntimeError("the run's own error"))
    assert "could not write" in caplog.text and "failed" in caplog.text
    assert (tmp_path / "summary.json").read_text() == first  # the earlier record, whole


@pytest.mark.parametrize("error, status", [(RuntimeError("boom"), "failed"), (KeyboardInterrupt(), "interrupted")])
def test_a_failed_or_interrupted_run_records_its_steps_run(tmp_path, error, status):
    """Issue 44.3: summary.json of a failed or interrupted run had no steps_run (the README's table lists it)."""
    RunSummary(tmp_path).fail(error)
    assert json.loads((tmp_path / "summary.json").read_text())["steps_run"] == 0  # before the first step
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (0, 1, 2, 3)))
    RunSummary(tmp_path).fail(error)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == status and summary["steps_run"] == 3


def test_a_finished_trainer_leaves_no_lock_file_and_a_killed_ones_is_taken_over(tmp_path):
    """Issue 44.18: `.grpo.lock` stayed in finished run dirs naming a dead pid (the README: the running trainer
    holds it)."""
    import subprocess
    import sys

    from grpo.run_records import lock_run_dir, unlock_run_dir

    run = tmp_path / "run"
    code = f"from pathlib import Path; from grpo.run_records import lock_run_dir; lock_run_dir(Path({str(run)!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert run.is_dir() and not (run / ".grpo.lock").exists()
    (run / ".grpo.lock").write_text("pid 999999999\n")  # a killed trainer's: no process holds the lock
    lock_run_dir(run)
    assert (run / ".grpo.lock").read_text() == f"pid {os.getpid()}\n"
    unlock_run_dir()
    assert not (run / ".grpo.lock").exists()


def test_device_memory_of_a_run_dir_discarded_at_start_up_is_not_recorded(tmp_path):
    """A start-up mistake discards the run dir it created; the teardown that follows (device memory after the job,
    on a GPU) writes nothing there and raises nothing, so the mistake's own message is what the user reads. On a
    lent GPU the write once raised FileNotFoundError after the ConfigError's message (2026-11-27)."""
    from grpo.run_records import record_device_memory

    gone = tmp_path / "discarded"
    record_device_memory(gone, {"device_used_gb": 0.5, "allocated_gb": 0.0, "reserved_gb": 0.0}, settle_s=0)
    assert not gone.exists()


def _start_racing(config, ready, done, results) -> None:
    """One trainer's start-up checks (RunDirGuard) in a forked process, released with the other's; it holds what it
    took (the run dir's lock) until the other has finished its own."""
    import contextlib
    import io

    from grpo.run_records import RunDirGuard

    err, code = io.StringIO(), 0
    ready.wait()
    with contextlib.redirect_stderr(err):
        try:
            RunDirGuard().on_run_start(config)
        except SystemExit as e:
            code = e.code
    results.put((code, err.getvalue()))
    done.wait()


def _probe_often(run_dir, ready, results) -> None:
    from grpo.config.run_dir import check_run_dir

    ready.wait()
    try:
        for _ in range(300):
            check_run_dir(run_dir)
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(f"{type(e).__name__}: {e}")
        return
    results.put("ok")


def test_two_trainers_starting_in_one_fresh_run_dir_at_once_the_loser_is_told_it_is_in_use(tmp_path):
    """Issue 62.8: both wrote and unlinked one `.write_probe`, and the loser was told the dir "is not writable". Now
    each probes with a name of its own, one takes the lock, the other is told the dir is in use, and it does not
    discard the dir the winner runs in."""
    import multiprocessing

    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from grpo.config import register_configs

    ctx = multiprocessing.get_context("fork")
    # The probe alone, hammered by two processes: a shared name fails within a few hundred rounds.
    ready, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_probe_often, args=(tmp_path / "probed", ready, results)) for _ in range(2)]
    for p in procs:
        p.start()
    assert [results.get(timeout=60) for _ in procs] == ["ok", "ok"]
    for p in procs:
        p.join(timeout=30)

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        config = compose("train", overrides=["~experiment"], return_hydra_config=True)
    for round_ in range(5):
        run = tmp_path / f"run{round_}"
        with open_dict(config):
            config.hydra.run.dir = str(run)
        ready, done, results = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_start_racing, args=(config, ready, done, results)) for _ in range(2)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        assert [code for code, _ in outcomes] == [0, 1], outcomes
        assert f"ConfigError: run dir {run} is in use by a running trainer (" in outcomes[1][1], outcomes
        assert run.is_dir()  # the loser left the winner's dir alone


def test_a_resumed_runs_summary_gives_this_sessions_and_the_whole_runs_wall_seconds(tmp_path):
    """Issue 62.17: `wall_seconds` after a resume covered only the last session. Now it is this session's and
    `run_wall_seconds` adds every earlier session's, resumed into another dir and then again in place."""
    from hydra import compose, initialize_config_dir

    from grpo.config import register_configs
    from grpo.job import Job

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "summary.json").write_text(json.dumps({"status": "interrupted", "wall_seconds": 100.0}))  # older form
    register_configs()
    for resume, expected_earlier in ((first, 100.0), (second, None)):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=["~experiment", "train.device=cpu", f"train.resume={resume}"])
        earlier = json.loads((resume / "summary.json").read_text())
        earlier_total = earlier.get("run_wall_seconds", earlier["wall_seconds"])
        job = Job(run_dir=second, multirun=False, rank0=True)
        job.start(cfg)
        job.completed([0.5])
        summary = json.loads((second / "summary.json").read_text())
        assert 0 <= summary["wall_seconds"] < 30
        assert summary["run_wall_seconds"] == pytest.approx(earlier_total + summary["wall_seconds"])
        assert expected_earlier is None or earlier_total == expected_earlier
    assert summary["run_wall_seconds"] >= 100.0  # the first session still counted after the second resume

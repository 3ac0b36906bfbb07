"""Issue 22.3: Ctrl-C or SIGTERM ends a run with one short block (step, checkpoint, resume command, server), no traceback."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import uuid

import pytest
from omegaconf import OmegaConf

from conftest import REPO, free_port
from grpo.stop import command, config_flags, exit_code, program, signal_name
from test_train_e2e import QUICK, assert_clean, metrics


def test_signal_names_and_exit_codes_follow_the_shell_convention():
    assert signal_name(KeyboardInterrupt()) == "SIGINT (Ctrl-C)"
    assert signal_name(KeyboardInterrupt(f"signal {int(signal.SIGTERM)}")) == "SIGTERM"
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_code(KeyboardInterrupt(f"signal {int(signal.SIGTERM)}")) == 143


def test_resume_command_keeps_program_config_flags_and_quotes_overrides(tmp_path):
    run = tmp_path / "my run"
    argv = ["grpo-train", "--config-dir", "/home/me/confs", "-cn=mine", "mode=lora_only", "train.resume=/old"]
    overrides = ["mode=lora_only", "server.extra_args=[--x,2]", "train.resume=/old", "hydra.run.dir=/elsewhere"]
    cmd = command(argv, overrides, run)
    assert shlex.split(cmd) == [
        "grpo-train", "--config-dir", "/home/me/confs", "-cn=mine", "mode=lora_only", "server.extra_args=[--x,2]",
        f"train.resume={run}", f"hydra.run.dir={run}",
    ]
    assert program(["train.py"]) == "python train.py"
    assert config_flags(["train.py", "a=1"]) == []


def test_a_trainer_started_by_grpo_stack_names_the_stack_command_to_resume(tmp_path, monkeypatch):
    """Under `python -m grpo.stack`, the stop block gave the trainer's own command (train.py data=atropos
    data.url=<the stack's run-api, stopped with it> server.port=...), whose run-api was gone: following it failed."""
    from grpo.stop import LAUNCHER_ENV

    run = tmp_path / "run"
    monkeypatch.setenv(LAUNCHER_ENV, f"python -m grpo.stack --task gsm8k train.steps=3 hydra.run.dir={run}")
    trainer = ["/x/train.py", "~experiment", "train.steps=3", "data=atropos", "data.url=http://127.0.0.1:4242"]
    assert shlex.split(command(trainer, trainer[1:], run)) == [
        "python", "-m", "grpo.stack", "--task", "gsm8k", "train.steps=3", f"train.resume={run}", f"hydra.run.dir={run}"]
    assert command(trainer, trainer[1:]) == "python -m grpo.stack --task gsm8k train.steps=3"


@pytest.mark.vllm
@pytest.mark.slow
def test_sigterm_prints_the_stop_block_writes_curves_and_the_command_resumes(tmp_path):
    """A SIGTERM in generation (a rollout request in flight) of a run with a server of its own: the run stops the
    server and its children. (The other phases, on an attached server: tests/test_reliability.py.)"""
    run = tmp_path / "run"
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1", GRPO_FAULT="sigterm@generate:3")
    overrides = [*QUICK, "train.steps=5", "train.checkpoint_every=2", f"server.port={free_port()}", f"hydra.run.dir={run}"]
    out = subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=400)
    text = out.stdout + out.stderr
    assert out.returncode == 143, text[-3000:]
    assert_clean(marker)
    assert "Traceback" not in text, text[-3000:]
    assert "grpo: stopped by SIGTERM; step 2 was the last one completed." in out.stderr, text[-3000:]
    assert f"last complete checkpoint: {run / 'checkpoints' / 'step_000002'}" in out.stderr
    assert f"the vLLM server this run started is stopped (log: {run / 'logs' / 'vllm.log'})" in out.stderr
    assert f"curves: {run / 'curves.png'}" in out.stderr
    assert (run / "curves.png").stat().st_size > 0 and not (run / "logs" / "vllm.pid").exists()
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"

    # The printed command is train.py with the same overrides, resuming in place; it composes as such.
    resume = next(line.split("resume with: ", 1)[1] for line in out.stderr.splitlines() if "resume with: " in line)
    argv = shlex.split(resume)
    assert argv[:2] == ["python", "train.py"]
    assert argv[2:] == [*[o for o in overrides if not o.startswith("hydra.run.dir=")],
                        f"train.resume={run}", f"hydra.run.dir={run}"]
    job = subprocess.run([sys.executable, *argv[1:], "--cfg", "job"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 0, job.stderr[-2000:]
    cfg = OmegaConf.create(job.stdout)
    assert cfg.train.resume == str(run) and cfg.train.steps == 5 and cfg.data.group_size == 4


@pytest.mark.slow
def test_a_real_error_keeps_its_traceback(tmp_path):
    # A model dir that passes the start-up check (config.json and a weights file) but does not load fails inside the
    # run: a real error, not a stop.
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"")
    out = subprocess.run([sys.executable, "train.py", "~experiment", "model.offline=null", f"model.name={broken}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-2000:]
    assert "Traceback" in text and "ConfigError" not in text
    assert "grpo: stopped by" not in text


def test_a_resume_into_another_dir_stopped_before_its_first_checkpoint_names_the_checkpoint_it_can_reach(tmp_path):
    """Issue 44.1: `train.resume=A hydra.run.dir=B`, stopped before B's first checkpoint, said "no complete checkpoint
    yet; start again with: python train.py ..." (from step 0, A's checkpoint still on disk); resuming B said it "has
    no complete checkpoint" and resuming A into B that B "already holds a run". The block gives the command that
    continues from A's checkpoint into B; that command passes the start-up checks, and resuming B names it."""
    import io

    from grpo.config import ConfigError
    from grpo.config.run_dir import check_run_dir_unused, raise_for_resume_dir
    from grpo.run_records import record_provenance
    from grpo.stop import report_stop

    a, b = tmp_path / "A", tmp_path / "B"
    ckpt = a / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    (ckpt / "COMPLETE").write_text("")
    b.mkdir()
    (b / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2, 3)))
    cfg = OmegaConf.create({"train": {"resume": str(a), "checkpoint_every": 5, "steps": 10}, "server": {},
                            "logging": {"plot": False}})
    record_provenance(b, cfg)
    overrides = ["train.steps=10", f"train.resume={a}", f"hydra.run.dir={b}"]
    out = io.StringIO()
    report = report_stop(KeyboardInterrupt(), cfg, b, overrides, argv=["train.py", *overrides], stream=out)
    assert report.checkpoint == ckpt
    assert f"last complete checkpoint: {ckpt}" in out.getvalue()
    assert shlex.split(report.resume_command) == ["python", "train.py", "train.steps=10", f"train.resume={a}",
                                                  f"hydra.run.dir={b}"]
    check_run_dir_unused(cfg, b)  # the printed command is not refused for B's rows
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ConfigError, match="already holds a run"):  # another run's resume into B still is
        check_run_dir_unused(OmegaConf.merge(cfg, {"train": {"resume": str(other)}}), b)
    with pytest.raises(ConfigError, match=f"it was resumed from {a}, whose latest is {ckpt}; continue from there "
                                          f"into the same dir with train.resume={a} hydra.run.dir={b}"):
        raise_for_resume_dir(b)

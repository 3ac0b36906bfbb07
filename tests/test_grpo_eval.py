"""grpo-eval (grpo.eval): a model directory and a run checkpoint evaluated after the run give the numbers the run's own
evaluation gave for the same weights (its step-0 row and the checkpoint step's row), on the session's shared server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from grpo.eval import EvalError, expand, load_config, main, target
from test_evaluation import QUICK, _train

# Every metric of an evaluation but its duration.
COMPARED = ("eval/accuracy", "eval/pass@k", "eval/mean@k", "eval/reward_mean", "eval/response_tokens_mean",
            "eval/unparsed_fraction", "eval/weight_version", "eval/prompts", "eval/k")


@pytest.mark.vllm
def test_grpo_eval_of_the_initial_model_and_a_checkpoint_equals_the_runs_own_evaluation(
        tmp_path, train_server, tiny_qwen2_dir):
    run_dir = tmp_path / "run"
    # Every held-out prompt's greedy completion logged (eval_samples.jsonl): the random tiny model scores 0 on the
    # digits task at both steps, so its completions are what tells the weights apart; a large learning rate moves them.
    t0 = time.monotonic()
    rows = _train(train_server, tiny_qwen2_dir, run_dir, "train.steps=2", "eval.every=2", "train.checkpoint_every=2",
                  "eval.samples_logged=8", "optimizer.lr=0.02", base=tuple(o for o in QUICK if o != "train.steps=3"))
    run_s = time.monotonic() - t0
    in_run = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(in_run) == [0, 2]
    checkpoint = run_dir / "checkpoints" / "step_000002"
    assert (checkpoint / "COMPLETE").exists()

    # The server now serves the step-2 weights; grpo-eval attaches to it (the run's server.external_url, its token)
    # and loads each model in turn: the initial directory first, then the checkpoint, whose run dir gives the config.
    out = tmp_path / "eval.json"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "grpo.eval", str(checkpoint), str(tiny_qwen2_dir), "--out", str(out),
         "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src"), GRPO_SERVER_TOKEN=train_server.token))
    eval_s = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"] == str(run_dir / ".hydra" / "config.yaml")
    evaluated = {r["step"]: r for r in result["rows"]}
    assert [r["step"] for r in result["rows"]] == [0, 2]  # by step, whatever the order given
    assert evaluated[0]["model"] == str(tiny_qwen2_dir.resolve()) and evaluated[2]["model"] == str(checkpoint.resolve())
    for step in (0, 2):
        for key in COMPARED:
            assert evaluated[step][key] == in_run[step][key], (step, key)
    assert "accuracy" in done.stdout and str(checkpoint.resolve()) in done.stdout
    # The same greedy completion of every held-out prompt as in the run, at each step; and the checkpoint's differ
    # from the initial model's, so a grpo-eval that evaluated the wrong weights would be caught.
    ours, runs = (_completions(p / "eval_samples.jsonl") for p in (tmp_path / "work", run_dir))
    assert ours == runs and len(ours[0]) == len(ours[2]) == in_run[0]["eval/prompts"]
    assert ours[0] != ours[2]
    print(f"\ntraining run {run_s:.1f} s, grpo-eval {eval_s:.1f} s")


def _completions(path: Path) -> dict[int, list[str]]:
    """The greedy completions an evaluation logged, by step."""
    out: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        out.setdefault(sample["step"], []).append(sample["completion"])
    return out


def test_targets_and_config_errors(tmp_path):
    ckpt = tmp_path / "checkpoint-25"
    ckpt.mkdir()
    with pytest.raises(EvalError, match="neither a model directory"):
        target(ckpt)
    (ckpt / "config.json").write_text("{}")
    t = target(ckpt)
    assert (t.step, t.version, t.adapter) == (25, 25, False)  # a Hugging Face Trainer's (TRL's) checkpoint name
    (ckpt / "trainer_state.json").write_text('{"global_step": 24}')  # a Hugging Face Trainer's own record
    assert target(ckpt).step == 24
    (ckpt / "adapter_config.json").write_text("{}")
    assert target(ckpt).adapter
    # A directory of checkpoints stands for each of them; other directories are not expanded.
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    assert sorted(p.name for p in expand(tmp_path)) == ["checkpoint-25", "checkpoint-5"]
    assert expand(ckpt) == [ckpt] and expand(tmp_path / "notes") == [tmp_path / "notes"]
    with pytest.raises(EvalError, match="no .hydra"):
        load_config(tmp_path, [])
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("server:\n  port: null\neval:\n  k: 4\n")
    assert load_config(tmp_path, ["eval.k=2"]).eval.k == 2
    with pytest.raises(EvalError, match="group option"):
        load_config(tmp_path, ["server=gpu"])


def test_help_and_a_bad_path_stop_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0 and "--run-dir" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="neither a model directory"):
        main(["~experiment", str(tmp_path / "nowhere")])
    assert not (tmp_path / "outputs").exists()  # nothing written before the arguments are checked


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["none", "lora_restart"])
def test_grpo_eval_on_a_server_of_its_own_equals_a_run_on_its_own(tmp_path, mode):
    """The user's path: a run that launched its server, then `grpo-eval --run-dir` launching one from the run's
    config: the initial weights and every checkpoint (full weights, or a LoRA adapter on the base model) give the
    run's own rows. Two vLLM starts, one after the other (~3-4 min on 2 loaded cores)."""
    from conftest import free_port
    from test_train_e2e import assert_clean, metrics, run_train

    run_dir = tmp_path / "run"
    base = [o for o in QUICK if o != "train.steps=3"]
    if mode == "lora_restart":
        base[0] = "experiment=cpu_tiny_lora_restart"  # tiny Qwen2, digits, an adapter served under `policy`
    out, marker = run_train(*base, "train.steps=2", "eval.every=2", "train.checkpoint_every=2", "mode.sync_every=1",
                            "eval.samples_logged=8", "optimizer.lr=0.02", f"server.port={free_port()}",
                            f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    in_run = {r["step"]: r for r in metrics(run_dir) if "eval/accuracy" in r}
    assert sorted(in_run) == [0, 2]
    assert (run_dir / "checkpoints" / "step_000002" / ("adapter_config.json" if mode == "lora_restart" else
                                                       "config.json")).exists()
    result = tmp_path / "eval.json"
    done = subprocess.run([sys.executable, "-m", "grpo.eval", "--run-dir", str(run_dir), f"server.port={free_port()}",
                           "--out", str(result), "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert done.returncode == 0, done.stderr[-3000:]
    evaluated = {r["step"]: r for r in json.loads(result.read_text())["rows"]}
    assert sorted(evaluated) == [0, 2]
    for step in (0, 2):
        for key in COMPARED:
            assert evaluated[step][key] == in_run[step][key], (step, key)
    ours, runs = (_completions(p / "eval_samples.jsonl") for p in (tmp_path / "work", run_dir))
    assert ours == runs and ours[0] != ours[2]

"""The GPU plans under bench/gpu/plans/ (bench/gpu/run_plan.py runs them on a lent machine, where a bad override
costs device time): every train.py job composes and passes the start-up checks as on a machine with CUDA and the
job's torchrun world size; every TRL job names an experiment that exists."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo.conf import CONFIG_DIR, EXPERIMENTS_DIR
from grpo.config import register_configs, validate
from grpo.models.tiny import offline_presets

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import run_plan  # noqa: E402

register_configs()
PLANS = sorted((REPO / "bench" / "gpu" / "plans").glob("*.txt"))
JOBS = [(plan.name, job) for plan in PLANS for wave in run_plan.parse_plan(plan.read_text()) for job in wave]


def test_there_are_plans():
    assert len(PLANS) >= 4 and len(JOBS) >= 10


@pytest.mark.parametrize("plan, job", JOBS, ids=[f"{p}:{j[0]}" for p, j in JOBS])
def test_plan_job_composes_and_validates(plan, job, tmp_path, monkeypatch):
    name, kind, *args = job
    command = run_plan.command(job, tmp_path)
    gpus = run_plan.job_gpus(job)
    if gpus is not None:
        assert gpus and all(g.isdigit() for g in gpus), f"{name}: gpus= takes GPU indices, got {args[0]}"
        args = args[1:]
    if kind == "trl":
        assert (EXPERIMENTS_DIR / f"{args[0]}.yaml").exists() and args[1].isdigit()
        return
    if kind == "grpo_eval":  # grpo-eval on another job's checkpoints: the experiment it evaluates exists
        assert (EXPERIMENTS_DIR / f"{args[0]}.yaml").exists() and "grpo.eval" in command
        return
    if kind == "sh":  # a script of bench/gpu/; sweep_run.sh's overrides compose (each swept key at its first value)
        assert (REPO / args[0]).is_file() and command[:2] == ["bash", args[0]]
        if args[0].endswith("sweep_run.sh"):
            # As the script: the real-model experiment unless the overrides name another.
            given = [a.split(",")[0] for a in args[2:]]
            experiment = next((a for a in given if a.startswith("experiment=")), "experiment=smollm2_chat_arith_shared")
            overrides = [experiment, *(a for a in given if not a.startswith("experiment="))]
            monkeypatch.setattr(sys.modules["grpo.config.validate"], "_cuda_available", lambda: True)
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
                validate(compose(config_name="train", overrides=overrides, return_hydra_config=True), tmp_path / name)
        return
    if kind == "plan":  # another plan of this folder, run by waves on the job's GPUs (its jobs are checked as its own)
        assert (REPO / args[0]).parent == REPO / "bench" / "gpu" / "plans" and (REPO / args[0]).is_file()
        assert command[1].endswith("run_plan.py") and command[2] == args[0] and "--nested" in command
        return
    if kind == "trl_step":
        import trl_step

        parsed = trl_step.parser().parse_args(command[2:])
        assert parsed.preset in offline_presets() and parsed.steps > 1
        return
    if kind == "gen_probe":
        import gen_probe

        from grpo.models.packaged import PACKAGED_MODELS

        parsed = gen_probe.parser().parse_args(command[2:])  # unknown variants fail here
        assert parsed.preset in [*offline_presets(), *PACKAGED_MODELS] and parsed.rounds >= 1
        return
    if args and args[0].startswith("pyspy="):
        rows, seconds = args.pop(0).split("=", 1)[1].split(":")
        assert int(rows) >= 1 and float(seconds) > 0 and "bench/gpu/pyspy_run.py" in command
    world = int(args[0].split("=", 1)[1]) if args and args[0].startswith("torchrun=") else 1
    assert ("torch.distributed.run" in command) == (world > 1)
    overrides = [a for a in command[command.index("train.py") + 1:] if not a.startswith("hydra.run.dir=")]
    monkeypatch.setattr(sys.modules["grpo.config.validate"], "_cuda_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        validate(cfg, tmp_path / name)


def test_a_job_that_writes_nothing_is_stopped_and_marked_stalled(tmp_path, monkeypatch):
    """A hung run must not hold a lease: the runner stops a job silent for --stall-s and records it."""
    monkeypatch.setattr(run_plan, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(run_plan, "command", lambda job, out: (
        ["sleep", "600"] if job[0] == "hung" else [sys.executable, "-c", "print('done')"]))
    t0 = time.monotonic()
    run_plan.run_wave([["hung", "x", "gpus=0"], ["quick", "x", "gpus=1"]], 0, tmp_path, stall_s=3)
    rows = {r["name"]: r for r in map(json.loads, (tmp_path / "jobs.jsonl").read_text().splitlines())}
    assert rows["hung"]["stalled"] and rows["hung"]["rc"] != 0
    assert not rows["quick"]["stalled"] and rows["quick"]["rc"] == 0
    assert time.monotonic() - t0 < 60


@pytest.mark.slow  # 14 s of the CI suite for bench tooling (the GPU plan runner's queue), not the product
def test_queue_starts_each_job_once_its_gpus_are_free_in_plan_order(tmp_path, monkeypatch):
    """--queue: a job on free GPUs starts beside a running one; a job needing a busy GPU waits for it, and a later job
    never overtakes it (a four-GPU job would otherwise wait behind a stream of one-GPU jobs)."""
    monkeypatch.setattr(run_plan, "RUNS", tmp_path / "runs")
    seconds = {"long": "3", "short": "0.5", "all": "0.5", "after": "0.1"}
    monkeypatch.setattr(run_plan, "command", lambda job, out: ["sleep", seconds[job[0]]])
    run_plan.run_queue([["long", "x", "gpus=0"], ["short", "x", "gpus=1"], ["all", "x"], ["after", "x", "gpus=1"]],
                       tmp_path, stall_s=60)
    rows = {r["name"]: r for r in map(json.loads, (tmp_path / "jobs.jsonl").read_text().splitlines())}
    assert rows["short"]["started_beside"] == ["long"]
    assert rows["all"]["started_beside"] == []  # waited for both
    assert rows["after"]["started_beside"] == []  # did not overtake "all" although GPU 1 was free
    assert all(r["rc"] == 0 for r in rows.values())
    order = [r["name"] for r in map(json.loads, (tmp_path / "jobs.jsonl").read_text().splitlines())]
    assert order.index("all") > order.index("long") and order.index("after") > order.index("all")


def test_the_queue_keeps_order_per_gpu_and_no_gpu_idles_behind_another_gpus_job():
    """--queue: a job waiting for a busy GPU holds back the later jobs of that GPU only (on a 2-GPU lease the jobs of
    GPU 0 once waited 5 minutes behind GPU 1's), and a job without gpus= still waits for every GPU and holds back
    everything after it."""
    atend, every25 = ["atend", "x", "gpus=1"], ["every25", "x", "gpus=1"]
    lora_seq, lora4, both = ["lora_seq", "x", "gpus=0"], ["lora4", "x", "gpus=1"], ["both", "x", "gpus=0,1"]
    assert run_plan.startable([every25, lora_seq, lora4, both], [atend]) == [lora_seq]
    assert run_plan.startable([every25, lora_seq, lora4, both], []) == [every25, lora_seq]
    assert run_plan.startable([both, lora4], [lora_seq]) == []
    assert run_plan.startable([["all", "x"], lora_seq], []) == [["all", "x"]]


def test_the_seeds_examples_and_the_long_completion_benchmark_are_planned():
    """The seeds' examples at their size (and the long-completion benchmark) are jobs of a GPU plan, so the checks
    above run on each of them as on a CUDA machine at its torchrun size."""
    planned = {(job[1], run_plan.command(job, Path("/tmp")).count("torch.distributed.run")) for _, job in JOBS}
    for experiment, torchrun in [("gsm8k_hermes8b_shared", 0), ("qwen14b_lora_only", 0), ("qwen14b_lora_fsdp2", 1),
                                 ("hermes8b_fsdp2", 1), ("hermes8b_fsdp2_broadcast", 1),
                                 ("qwen3b_long_completions", 0)]:
        assert (experiment, torchrun) in planned, experiment

"""Runs across nodes (issue 42, part 2), the parts testable on one CPU host: every rank sees rank 0's run files (the
start-up check), rank 0's result or failure reaches every rank, two torchrun "nodes" (`--nnodes 2`, c10d
rendezvous on 127.0.0.1, gloo) train, checkpoint and resume against one vLLM server, and the Slurm recipe
(scripts/slurm/grpo_multinode.sbatch) builds commands that split the nodes and compose with Hydra, without Slurm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from grpo.config.run_dir import SHARED_PROBE, shared_files_problem

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- what a rank sees of rank 0's files
def test_a_rank_that_reads_another_token_or_none_is_on_another_filesystem(tmp_path):
    run_dir, model_dir = tmp_path / "run", tmp_path / "model"
    run_dir.mkdir()
    model_dir.mkdir()
    (run_dir / SHARED_PROBE).write_text("token-of-rank-0")
    assert shared_files_problem(str(run_dir), "token-of-rank-0", str(model_dir), True) is None
    # A node-local directory of the same name holds another run's probe (or none): not rank 0's run dir.
    stale = shared_files_problem(str(run_dir), "another-token", str(model_dir), True)
    assert stale is not None and f"run dir {run_dir}" in stale and socket.gethostname() in stale
    (run_dir / SHARED_PROBE).unlink()
    assert f"run dir {run_dir}" in shared_files_problem(str(run_dir), "token-of-rank-0", str(model_dir), False)
    # A model dir rank 0 built locally must be there too; a hub id (not a local dir on rank 0) need not be.
    (run_dir / SHARED_PROBE).write_text("t")
    missing = shared_files_problem(str(run_dir), "t", str(tmp_path / "elsewhere"), True)
    assert missing is not None and "model dir" in missing and "run dir" not in missing
    assert shared_files_problem(str(run_dir), "t", "Qwen/Qwen2.5-3B-Instruct", False) is None


def _collectives_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0")  # two "nodes" of one process each: both have local rank 0
    from grpo.config.run_dir import check_ranks_see_run_files
    from grpo.config_values import ConfigError
    from grpo.trainer import fsdp

    info = fsdp.init_from_env("cpu")
    results: dict = {"rank": info.rank, "local_rank": info.local_rank}
    results["value"] = fsdp.rank0_result(lambda: f"computed by rank {fsdp.rank()}")

    def fail() -> str:
        raise ValueError("no such model")

    try:
        fsdp.rank0_result(fail)
    except (ValueError, RuntimeError) as e:
        results["error"] = f"{type(e).__name__}: {e}"
    run_dir = Path(out) / "run" if info.is_rank0 else Path(out) / f"tmp_rank{rank}"  # as Hydra gives ranks > 0
    run_dir.mkdir()
    check_ranks_see_run_files(run_dir, str(Path(out) / "model"))
    results["probe_left"] = (Path(out) / "run" / SHARED_PROBE).exists()
    # Another node: the same relative path names a directory of its own there (each rank works in its own
    # directory, as two hosts without a shared filesystem do): every rank refuses, naming rank 1's host.
    here = Path(out) / f"node{rank}"
    (here / "outputs").mkdir(parents=True)
    os.chdir(here)
    try:
        check_ranks_see_run_files(Path("outputs"), "hub/model-id")
    except ConfigError as e:
        results["refused"] = str(e)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    fsdp.destroy()


def test_rank0_result_and_the_run_files_check_on_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port

    (tmp_path / "model").mkdir()
    mp.spawn(_collectives_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["rank"], r1["rank"], r1["local_rank"]) == (0, 1, 0)
    assert r0["value"] == r1["value"] == "computed by rank 0"
    # Rank 0 raises its own error; the other rank does not hang in a collective, it hears why.
    assert r0["error"] == "ValueError: no such model"
    assert r1["error"] == "RuntimeError: rank 0 failed: ValueError: no such model"
    # Both saw rank 0's run dir (one filesystem here); the probe is gone once they had looked.
    assert not r0["probe_left"] and not r1["probe_left"]
    assert list((tmp_path / "run").iterdir()) == []
    for r in (r0, r1):
        assert "rank 1 on host" in r["refused"] and "run dir outputs" in r["refused"]
        assert "rank 0 on host" not in r["refused"] and "every node mounts" in r["refused"]
    assert list((tmp_path / "node0" / "outputs").iterdir()) == []  # rank 0 removed its probe


# ---------------------------------------------------------------- two "nodes" on one host
def _torchrun_node(rdzv_port: int, run_dir: Path, marker: str, overrides: list[str], env: dict[str, str]):
    """One node's torchrun (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous on 127.0.0.1), started in its own process
    group so the test stops only what it started."""
    from test_train_e2e import QUICK

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", marker,
           "--local-addr", "127.0.0.1", str(REPO / "train.py"), "mode=none", *QUICK, "train.checkpoint_every=1",
           f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, **env, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run_two_nodes(run_dir: Path, overrides: list[str], env: dict[str, str]) -> None:
    from conftest import free_port
    from test_train_e2e import assert_clean

    marker, port = f"GRPO_TEST_{uuid.uuid4().hex}", free_port()
    nodes = [_torchrun_node(port, run_dir, marker, overrides, env) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=540)[0] for node in nodes]
    finally:
        for node in nodes:  # a node left waiting in the rendezvous after the other failed
            if node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-4000:]
    assert_clean(marker)


@pytest.mark.slow  # 43 s on the shared 2-core machine, plus 26-40 s for the session server when it starts here
@pytest.mark.vllm
def test_two_torchrun_nodes_train_checkpoint_and_resume(tmp_path, train_server, tiny_qwen2_dir):
    """`torchrun --nnodes 2 --nproc-per-node 1` twice, as two nodes would start it: one process group over both
    (global ranks 0 and 1, each local rank 0), FSDP2 over gloo, mode=none against one vLLM server attached by URL.
    Global rank 0 alone writes the run dir and checkpoints; a second pair of nodes resumes from them."""
    from conftest import attach
    from test_train_e2e import metrics

    run_dir = tmp_path / "run"
    external, env = attach(train_server, tiny_qwen2_dir)
    _run_two_nodes(run_dir, ["train.steps=2", external], env)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["sync/version"] for r in rows] == [1.0, 2.0]
    complete = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    assert complete == ["step_000001", "step_000002"]
    assert len(torch.load(run_dir / "checkpoints" / "step_000002" / "rng_ranks.pt", weights_only=False)) == 2
    assert not (run_dir / SHARED_PROBE).exists()
    assert json.loads((run_dir / "provenance.json").read_text())["argv"][0].endswith("train.py")

    external, env = attach(train_server, tiny_qwen2_dir)
    _run_two_nodes(run_dir, ["train.steps=3", f"train.resume={run_dir}", external], env)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["sync/version"] == 3.0  # the weight version goes on from the checkpoint's
    assert json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["step"] == 3


# ---------------------------------------------------------------- the Slurm recipe, without Slurm
SBATCH = REPO / "scripts" / "slurm" / "grpo_multinode.sbatch"


def _recipe(tmp_path: Path, nodes: list[str], overrides: list[str], **settings: str) -> subprocess.CompletedProcess:
    """The sbatch script run as Slurm would run it on a job of `nodes`, in dry-run mode: `scontrol` (Slurm's, absent
    here) is a stand-in that lists the nodes; each srun command's arguments land in tmp_path/out."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 2\n' + "".join(f"echo {n}\n" for n in nodes))
    scontrol.chmod(0o755)
    outside = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}  # the recipe's own
    env = dict(outside, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="n[1-9]", SLURM_JOB_ID="77",
               SLURM_SUBMIT_DIR=str(tmp_path), GRPO_SLURM_DRY_RUN=str(out), PYTHON=sys.executable, **settings)
    return subprocess.run(["bash", str(SBATCH), *overrides], env=env, capture_output=True, text=True, timeout=60)


def _args(tmp_path: Path, name: str) -> list[str]:
    return (tmp_path / "out" / f"{name}.args").read_text().split("\0")[:-1]


def _run_task(args: list[str], tmp_path: Path, **env: str) -> list[str]:
    """One srun task's `bash -c` script run here with PYTHON a stand-in that records each command it was given (one
    line each, CUDA_VISIBLE_DEVICES first): what that node would start."""
    record = tmp_path / "started.txt"
    fake = tmp_path / "bin" / "fake_python"
    fake.write_text(f'#!/bin/sh\necho "${{CUDA_VISIBLE_DEVICES:-}} $*" >> {record}\n')
    fake.chmod(0o755)
    task = args[args.index("bash"):]
    subprocess.run(task, env=dict(os.environ, PYTHON=str(fake), **env), check=True, timeout=60)
    return sorted(record.read_text().splitlines())


def test_slurm_recipe_is_valid_bash_and_refuses_a_job_without_trainer_nodes(tmp_path):
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    out = _recipe(tmp_path, ["n1"], [], MODEL="m")
    assert out.returncode == 1 and "leaves none for the trainer" in out.stderr
    out = _recipe(tmp_path, ["n1", "n2"], [])  # no MODEL
    assert out.returncode != 0 and "set MODEL" in out.stderr


def test_slurm_recipe_splits_the_nodes_and_its_trainer_command_composes(tmp_path):
    model = "Qwen/Qwen2.5-3B-Instruct"
    out = _recipe(tmp_path, ["n1", "n2", "n3"], ["model=qwen3b", "mode=broadcast", "train.steps=5"], MODEL=model,
                  GPUS_PER_NODE="4", GPUS_PER_REPLICA="2", VLLM_ARGS="--max-model-len 4096")
    assert out.returncode == 0, out.stderr
    replicas, trainer = _args(tmp_path, "replicas"), _args(tmp_path, "trainer")
    # The last node serves, the others train; the replicas run where the trainer does not.
    assert "--nodelist=n3" in replicas and "--nodelist=n1,n2" in trainer

    # The replica node starts two servers of 2 GPUs each, disjoint, on consecutive ports, with grpo's server (its
    # worker extension) and, for mode=broadcast, vLLM's NCCL weight-transfer engine.
    started = _run_task(replicas, tmp_path)
    assert len(started) == 2
    for gpus, port, line in zip(("0,1", "2,3"), (8000, 8001), started):
        assert line.startswith(f"{gpus} -m grpo.serve --model {model} --host 0.0.0.0 --port {port} ")
        assert "--tensor-parallel-size 2 --weight-transfer-config {\"backend\": \"nccl\"} --max-model-len 4096" in line

    # Each trainer node runs torchrun with its rank from Slurm (static rendezvous: global rank 0 on n1).
    (tmp_path / "started.txt").unlink()
    (node1,) = _run_task(trainer, tmp_path, SLURM_PROCID="1")
    assert node1.startswith(" -m torch.distributed.run --nnodes 2 --nproc-per-node 4 --node-rank 1 "
                            "--master-addr n1 --master-port 29500 ")

    # The trainer's overrides compose with Hydra (`grpo-train ... --cfg job`): the replicas by URL, the served model.
    assert trainer[trainer.index("--module") + 1] == "grpo.train"  # grpo-train's module: no checkout path needed
    overrides = trainer[trainer.index("grpo.train") + 1:]
    urls = ["http://n3:8000", "http://n3:8001"]
    assert f"server.external_urls=[{','.join(urls)}]" in overrides
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (parsed,) = OverridesParser.create().parse_overrides([o for o in overrides if o.startswith("server.external_urls")])
    assert parsed.value() == urls
    composed = subprocess.run([sys.executable, "-m", "grpo.train", *overrides, "--cfg", "job"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert composed.returncode == 0, composed.stderr[-3000:]
    import yaml

    cfg = yaml.safe_load(composed.stdout)
    assert cfg["model"]["name"] == model and cfg["train"]["steps"] == 5
    assert cfg["mode"]["_target_"].endswith("NCCLBroadcastSync") and cfg["mode"]["master_address"] == "n1"
    if "external_urls" in cfg["server"]:
        assert cfg["server"]["external_urls"] == urls


def test_slurm_recipe_mode_none_starts_plain_replicas(tmp_path):
    """mode=none (reload from the run dir): no NCCL engine on the replicas, no NCCL address for the trainer; one
    replica per GPU by default; the GPUs and CPUs of a node from the job's request."""
    out = _recipe(tmp_path, ["a", "b", "c", "d"], ["mode=none"], MODEL="/shared/model", VLLM_NODES="2",
                  SLURM_GPUS_PER_NODE="h100:2", SLURM_CPUS_ON_NODE="32", RUN_DIR="/shared/runs/r1")
    assert out.returncode == 0, out.stderr
    replicas, trainer = _args(tmp_path, "replicas"), _args(tmp_path, "trainer")
    assert "--nodelist=c,d" in replicas and "--nodelist=a,b" in trainer
    assert "--cpus-per-task=32" in replicas and "--cpus-per-task=32" in trainer  # each node's CPUs, not one
    assert trainer[trainer.index("grpo-trainer") + 2] == "2"  # processes per node: --gpus-per-node's count
    assert "--weight-transfer-config" not in replicas and not any("master_address" in a for a in trainer)
    assert ["0 ", "1 "] == [line[:2] for line in _run_task(replicas, tmp_path)]
    assert "server.external_urls=[http://c:8000,http://c:8001,http://d:8000,http://d:8001]" in trainer
    assert "hydra.run.dir=/shared/runs/r1" in trainer and "model.name=/shared/model" in trainer

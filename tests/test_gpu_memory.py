"""GPU only (skipped without CUDA and vLLM): a multirun's jobs hand their device memory back. Each job of
`python train.py -m mode=shared_vllm,lora_only` writes `device_memory.json` (device-wide GiB in use at its start
and after its teardown: trainer and server); after must be within 1 GiB of before, for both jobs, so job 1 starts
where job 0 did. On the H100 a shared_vllm then lora_only multirun once kept ~20.9 GB from job 0 through job 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_multirun_jobs_return_device_memory_to_their_start(tmp_path):
    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO / "src")}
    sweep = tmp_path / "sweep"
    args = ["~experiment", "server=gpu", "server.gpu_memory_utilization=0.3", "train.device=cuda", "train.steps=2",
            "train.micro_batch_size=8", "train.grad_accum=2", "eval=off", "logging.progress_bar=false",
            "logging.plot=false", "mode=shared_vllm,lora_only", f"hydra.sweep.dir={sweep}",
            # The teardown is what is measured: a server kept for a next job would hold its memory on purpose.
            "server.reuse_across_jobs=false"]
    proc = subprocess.run([sys.executable, "train.py", "-m", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = sorted(sweep.glob("*/device_memory.json"))
    assert len(jobs) == 2, proc.stderr[-4000:]
    for path in jobs:
        mem = json.loads(path.read_text())
        grown = mem["after_teardown"]["device_used_gb"] - mem["before"]["device_used_gb"]
        assert grown < 1.0, f"{path.parent.name}: {grown:.2f} GiB still in use after teardown: {mem}"
        assert json.loads((path.parent / "summary.json").read_text())["status"] == "completed"

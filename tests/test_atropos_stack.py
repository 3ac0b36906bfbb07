"""The Atropos path end to end on CPU: environment → run-api → trainer → inference server, via `python -m grpo.stack`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

from conftest import REPO, free_port

pytestmark = [pytest.mark.vllm]


def _start_stack(tmp_path, steps: int):
    api_port, server_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "grpo.stack", f"--api-port={api_port}", "--group-size=8", "--grace=60",
        f"--log-dir={tmp_path / 'logs'}",
        f"train.steps={steps}", "train.micro_batch_size=16", "train.grad_accum=1", "train.checkpoint_every=2",
        # server.enforce_eager=true: vLLM starts without torch.compile (~25 s less here).
        f"server.port={server_port}", "server.enforce_eager=true", "logging.progress_bar=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    out = open(tmp_path / "stack.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{api_port}", server_port


def _descendants(proc) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _rows(tmp_path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _port_closed(port: int) -> bool:
    try:
        requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
        return False
    except requests.RequestException:
        return True


def _log(tmp_path) -> str:
    return (tmp_path / "stack.log").read_text(errors="replace")[-4000:]


@pytest.mark.slow  # 20-60 s of the CI suite's 25-minute budget: run with `pytest -m slow`
def test_stack_trains_from_the_environment(tmp_path):
    proc, api_url, server_port = _start_stack(tmp_path, steps=3)
    seen: set = set()
    steps_seen = []
    try:
        deadline = time.monotonic() + 420
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(_descendants(proc))
            try:
                steps_seen.append(requests.get(api_url + "/status", timeout=2).json()["current_step"])
            except requests.RequestException:
                pass
            time.sleep(1)
        assert proc.poll() == 0, _log(tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # Groups came from the environment: Atropos-shaped, with rollout log-probs, none dropped.
        assert r["data/sequences"] == 16 and r["data/groups"] == 2
        assert r["data/missing_logprobs"] == 0 and r["data/dropped_malformed"] == 0
    assert max(steps_seen) >= 2  # run-api's step advanced with the trainer's /batch calls
    # Every process of the stack is gone, the trainer's vLLM server included.
    assert seen and not [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert _port_closed(server_port) and _port_closed(int(api_url.rsplit(":", 1)[1]))
    assert "mean score" in (tmp_path / "logs" / "env.log").read_text()


@pytest.mark.slow
def test_stack_stops_everything_on_sigterm(tmp_path):
    proc, api_url, server_port = _start_stack(tmp_path, steps=1000)
    seen: set = set()
    try:
        deadline = time.monotonic() + 420
        while len(_rows(tmp_path)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, _log(tmp_path)
            seen.update(_descendants(proc))
            time.sleep(1)
        seen.update(_descendants(proc))
        os.kill(proc.pid, signal.SIGTERM)  # the stack itself; it stops its children
        assert proc.wait(240) == 130, _log(tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert _port_closed(server_port)
    # The trainer stopped cleanly: its checkpoints are complete directories (atomic writes).
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*")) if (tmp_path / "run" / "checkpoints").exists() else []
    assert ckpts, _log(tmp_path)

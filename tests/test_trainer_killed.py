"""A trainer killed outright (SIGKILL: the OOM killer, a scheduler's last word) leaves no inference server behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import free_port
from grpo.inference.preload import PRELOADED_NOTE
from test_reliability import start_train
from test_train_e2e import processes_with_marker


@pytest.mark.vllm
def test_a_trainer_killed_while_its_server_starts_takes_the_server_with_it(tmp_path):
    """The server dies with its launcher by PR_SET_PDEATHSIG's SIGTERM, which vLLM does not act on while its engine
    starts: before, a trainer SIGKILLed then left the server running for good (seen for minutes), with its port and
    memory. ~15 s: the trainer's start and a part of vLLM's."""
    run = tmp_path / "run"
    proc, marker = start_train("train.steps=2", f"server.port={free_port()}", f"hydra.run.dir={run}")
    log = run / "logs" / "vllm.log"
    try:
        deadline = time.monotonic() + 120
        # Into the engine's start-up: vLLM has read the model's config, the engine core is not up yet.
        while not (log.exists() and "Resolved architecture" in log.read_text(errors="replace")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        time.sleep(2)
        assert "Application startup complete" not in log.read_text(errors="replace")
        # The server is the command's preloaded process (grpo.inference.preload), tied to the trainer all the same.
        assert PRELOADED_NOTE in log.read_text(errors="replace")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 15
        while processes_with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_with_marker(marker) == [], log.read_text(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_with_marker(marker):  # what this test's run started, one by one, if the test failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

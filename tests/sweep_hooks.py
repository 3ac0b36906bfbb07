"""Test-only Hydra callback for tests/test_sweep_server.py: a kept vLLM server that dies between a sweep's jobs."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class KillServerAfterJob(Callback):
    """After job `job` of a multirun has ended (and kept its server), SIGKILL that server's process group, whose
    pid the job's run dir holds in logs/vllm.pid."""

    def __init__(self, job: int = 0) -> None:
        self.job = int(job)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:  # noqa: ARG002
        if int(config.hydra.job.num) != self.job:
            return
        pid = int((Path(config.hydra.runtime.output_dir) / "logs" / "vllm.pid").read_text())
        os.killpg(pid, signal.SIGKILL)
        print(f"sweep_hooks: killed the kept vLLM server (pgid {pid}) after job {self.job}", flush=True)

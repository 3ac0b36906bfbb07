"""The command's preloaded vLLM server process (grpo.inference.preload): when a command starts one, when a launch
may use it, and that a command which launches none leaves none behind. A run through it: tests/test_trainer_killed.py
and every `train.py` run with a server of its own."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo.inference import preload

REPO = Path(__file__).resolve().parents[1]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["train.steps=2"], {}, True),
    (["experiment=smollm2_chat_arith_shared", "server.device=0"], {}, True),
    (["train.steps=2"], {"GRPO_PRELOAD_SERVER": "0"}, False),  # the opt-out
    (["train.steps=2"], {"WORLD_SIZE": "2"}, False),  # torchrun's ranks
    (["-m", "optimizer.lr=1e-4,1e-3"], {}, False),  # a multirun's jobs
    (["--cfg", "job"], {}, False),  # prints and exits
    (["--help"], {}, False),
    (["server.external_url=http://127.0.0.1:9000"], {}, False),  # a server given: none to launch
    (["+server.external_urls=[http://a:1,http://b:2]"], {}, False),
    (["~server.external_url"], {}, True),  # removed: the run launches its own
])
def test_a_command_preloads_a_server_unless_it_launches_none_or_is_told_not_to(argv, env, expected):
    assert preload.wanted(argv, env) is expected


def test_only_variables_read_while_vllm_imports_block_the_preloads_use():
    start = {"PATH": "/bin", "HF_HOME": "/h", "OMP_NUM_THREADS": "8", "RANK": "0"}
    # What the launcher itself sets is read when the server runs.
    launch = {"PATH": "/bin", "HF_HOME": "/h", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "1",
              "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "GRPO_SERVER_TOKEN": "t", "GRPO_WEIGHT_VERSION": "3", "RANK": "0"}
    assert preload.import_blockers(start, launch) == []
    # vLLM's logging level and the Hugging Face cache are read while importing; a removed variable counts too.
    launch |= {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HOME": "/elsewhere"}
    del launch["PATH"]
    assert preload.import_blockers(start, launch) == ["HF_HOME", "PATH", "VLLM_LOGGING_LEVEL"]


def test_a_launch_the_preload_cannot_serve_stops_it_and_a_launch_it_can_takes_it_once():
    command = [sys.executable, "-m", preload.SERVER_MODULE, "--model", "m"]
    assert preload.start([]) and preload.running_pid() is not None
    pid = preload.running_pid()
    try:
        assert preload.take(command, dict(os.environ, VLLM_LOGGING_LEVEL="DEBUG")) is None  # imported under another
        assert preload.running_pid() is None and _gone(pid, 15)
        assert preload.start([])
        taken = preload.take(command, dict(os.environ, GRPO_WEIGHT_VERSION="2"))
        assert taken is not None and preload.running_pid() is None  # taken once: nothing is left to take
        taken.stop()
        assert _gone(taken.proc.pid, 15)
    finally:
        preload.discard()


@pytest.mark.parametrize("overrides", [["train.seed=not-a-number"],
                                       ["~experiment", "server.extra_args=[--no-such-vllm-flag]"]])
def test_a_command_that_ends_before_or_without_its_launch_leaves_no_preloaded_process(tmp_path, overrides):
    """A config mistake exits before any launch; a server that cannot start exits its preloaded process with it
    (the launch took it: the server's own error, from the same process)."""
    script = ("import sys; sys.argv[0] = 'grpo-train'; from grpo.inference import preload; import grpo.command; "
              "print('preloaded', preload.running_pid(), flush=True); grpo.command.run()")
    out = subprocess.run([sys.executable, "-c", script, *overrides, f"hydra.run.dir={tmp_path / 'run'}",
                          "server.port=null", "server.startup_timeout_s=120"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    pid = int(out.stdout.split("preloaded ", 1)[1].split()[0])
    assert _gone(pid, 15)
    if "extra_args" in overrides[-1]:  # the launch went through the preloaded process: its log says so
        log = (tmp_path / "run" / "logs" / "vllm.log").read_text()
        assert preload.PRELOADED_NOTE in log and "no-such-vllm-flag" in log, log[-2000:]
        assert re.search(r"the imports took [\d.]+ s and ended [\d.]+ s (after|before) the launch", log), log[-2000:]

"""Issue 6: faults, bad input and clean shutdown, with the real vLLM CPU engine and the real run-api.

Faults are injected through GRPO_FAULT (grpo/faults.py) so they land in a named phase of a named step, or from
outside (killing the server's process group by the pid in <run_dir>/logs/vllm.pid). Runs that need no server of
their own attach to the session's shared server (server.external_url) to save vLLM start-ups (~35 s each here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
import torch

from conftest import REPO, attach, free_port, server_cfg
from test_train_e2e import QUICK, assert_clean, metrics, processes_with_marker

# Quick steps (QUICK: eager vLLM starts without torch.compile, far quicker on a new weights directory), no plot.
# A small KV cache (~1.2 GB) so several engines fit beside each other on this shared machine.
BASE = [*QUICK, "logging.plot=false", "server.kv_cache_gb=0.25"]
EVERY_STEP = "train.checkpoint_every=1"


def start_train(*overrides: str, fault: str = "", env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, **(env or {}), GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1", GRPO_FAULT=fault)
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *BASE, *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, marker


def train(*overrides: str, fault: str = "", timeout: float = 400, env: dict[str, str] | None = None
          ) -> tuple[int, str, str]:
    """Run train.py to its end; returns (exit code, output, marker)."""
    proc, marker = start_train(*overrides, fault=fault, env=env)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, marker


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metrics(run_dir)]


def assert_valid_checkpoint(run_dir: Path, step: int, model_dir: Path) -> None:
    """The newest complete checkpoint is `step`, loads into a fresh model, and holds only finite weights."""
    from transformers import AutoModelForCausalLM

    from grpo.trainer.checkpoint import CheckpointManager

    ckpts = CheckpointManager(run_dir)
    latest = ckpts.latest()
    assert latest is not None and latest.name == f"step_{step:06d}", latest
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    state = ckpts.load(latest, model)
    assert state["step"] == step
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.load(latest / "optimizer.pt", weights_only=False)
    # Nothing half-written is left beside it.
    assert not [p.name for p in ckpts.root.iterdir() if p.name.startswith(".")]


def server_starts(run_dir: Path, log: str = "vllm.log") -> list[str]:
    """The --model of every server start in the run's vllm.log (this session's; an earlier session's is
    vllm.<n>.log), in order."""
    text = (run_dir / "logs" / log).read_text(errors="replace")
    return re.findall(r"===== grpo: starting .* --model (\S+)", text)


@pytest.fixture()
def shared_server(train_server, tiny_qwen2_dir) -> tuple[str, dict[str, str]]:
    """The session's server (conftest.train_server) that runs without a server of their own attach to, back on the
    initial weights: (the server.external_url override, the environment with its token)."""
    return attach(train_server, tiny_qwen2_dir)


# ---------------------------------------------------------------------------------------------------- server faults
@pytest.mark.slow  # 40-105 s of the CI suite's 25-minute budget: run with `pytest -m slow`
@pytest.mark.vllm
def test_server_hang_and_crash_restart_on_current_weights_then_clear_error_and_resume(tmp_path, tiny_qwen2_dir):
    run = tmp_path / "run"
    port = free_port()
    # Step 2: the server hangs (SIGSTOP) -> the health check's timeout notices, restart 1 of 1.
    # Step 3: it crashes (SIGKILL) -> no restarts left -> a clear error.
    code, out, marker = train("train.steps=4", EVERY_STEP, "server.max_restarts=1", f"server.port={port}", f"hydra.run.dir={run}",
                              fault="stop_server@2;kill_server@3")
    assert code != 0, out[-3000:]
    assert "not answering /health within 10s; restart 1 of 1 on weight version 1" in out
    assert "giving up after 1 restarts (server.max_restarts=1)" in out
    # The restart served the weights of step 1 (served_weights/v1), not the initial ones.
    starts = server_starts(run)
    assert starts == [str(tiny_qwen2_dir), str(run / "served_weights" / "v1")]
    assert steps(run) == [1, 2]
    assert_valid_checkpoint(run, 2, tiny_qwen2_dir)
    assert_clean(marker)
    assert not (run / "logs" / "vllm.pid").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"

    # Resume; kill the server's process group from outside while step 4 runs: restarted, the run completes.
    proc, marker = start_train("train.steps=6", EVERY_STEP, f"server.port={port}", f"hydra.run.dir={run}",
                               f"train.resume={run}")
    deadline = time.monotonic() + 300
    while 3 not in steps(run):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    os.killpg(int((run / "logs" / "vllm.pid").read_text()), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert steps(run) == [1, 2, 3, 4, 5, 6]
    assert server_starts(run, "vllm.1.log") == [str(tiny_qwen2_dir), str(run / "served_weights" / "v1")]
    starts = server_starts(run)  # the resumed session's own log: the first session's was moved to vllm.1.log
    assert starts[0] == str(run / "checkpoints" / "step_000002")  # resume serves the checkpoint's weights
    assert len(starts) == 2 and "/served_weights/v" in starts[1]  # the restart serves the latest synced weights
    assert_valid_checkpoint(run, 6, tiny_qwen2_dir)
    assert_clean(marker)


# ---------------------------------------------------------------------------------------------------- SIGTERM
@pytest.mark.slow  # 20-60 s of the CI suite's 25-minute budget: run with `pytest -m slow`
@pytest.mark.vllm
def test_sigterm_in_each_phase_keeps_a_valid_checkpoint_and_resume_continues(tmp_path, tiny_qwen2_dir, shared_server):
    # (A SIGTERM in generation of a run with a server of its own, which it stops: tests/test_clean_stop.py.)
    run = tmp_path / "run"
    external, env = shared_server
    url = external.split("=", 1)[1]
    # Generation: the process exits; the server it attached to keeps running.
    code, out, marker = train("train.steps=5", EVERY_STEP, external, f"hydra.run.dir={run}", fault="sigterm@generate:2",
                              env=env)
    assert code == 143
    # The stop block (grpo.stop), no traceback: the signal landed in step 2's generation.
    assert "grpo: stopped by SIGTERM; step 1 was the last one completed." in out and "Traceback" not in out, out[-3000:]
    assert f"server: attached to {url}, which this run did not start; it keeps running" in out, out[-3000:]
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert_clean(marker)
    assert not (run / "logs" / "vllm.pid").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert_valid_checkpoint(run, 1, tiny_qwen2_dir)

    # No hydra.run.dir: a resumed run continues in the run dir it resumes (issue 21 item 3).
    ext = [external, f"train.resume={run}", "train.steps=5", EVERY_STEP]
    # The optimizer step of step 3: step 2's checkpoint stays the last.
    code, out, marker = train(*ext, fault="sigterm@optimizer_step:3", env=env)
    assert code == 143 and "SIGTERM in optimizer_step of step 3" in out, out[-3000:]
    assert "grpo: stopped by SIGTERM; step 2 was the last one completed." in out
    assert_clean(marker)
    assert_valid_checkpoint(run, 2, tiny_qwen2_dir)
    # Writing step 4's checkpoint: the half-written one is discarded, step 3's stays the last.
    code, out, marker = train(*ext, fault="sigterm@checkpoint_write:4", env=env)
    assert code == 143 and "SIGTERM in checkpoint_write of step 4" in out, out[-3000:]
    assert f"last complete checkpoint: {run / 'checkpoints' / 'step_000003'}" in out
    assert_clean(marker)
    assert_valid_checkpoint(run, 3, tiny_qwen2_dir)
    assert not (run / "checkpoints" / "step_000004").exists()
    assert steps(run) == [1, 2, 3, 4]  # step 4 was trained: its row was written before the checkpoint
    # Resume to the end: every step present exactly once.
    code, out, marker = train(*ext, env=env)
    assert code == 0, out[-3000:]
    assert steps(run) == [1, 2, 3, 4, 5]
    assert_valid_checkpoint(run, 5, tiny_qwen2_dir)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


# ---------------------------------------------------------------------------------------------------- NaN / Inf
@pytest.mark.vllm
def test_nonfinite_steps_are_skipped_and_counted_then_the_run_stops(tmp_path, tiny_qwen2_dir, shared_server):
    run = tmp_path / "run"
    external, env = shared_server
    code, out, marker = train("train.steps=6", EVERY_STEP, "train.max_nonfinite_steps=2", external, f"hydra.run.dir={run}",
                              fault="nan_loss@2,4,5", env=env)
    assert code != 0
    assert "2 consecutive steps had a non-finite loss or gradient (train.max_nonfinite_steps=2)" in out, out[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["train/skipped_nonfinite"] for r in rows] == [0, 1, 1, 2]
    assert [r["loss"] is None for r in rows] == [False, True, False, True]
    # Skipped steps leave the weights finite (Adam's moments unpoisoned): the last checkpoint is clean.
    assert_valid_checkpoint(run, 4, tiny_qwen2_dir)
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    assert_clean(marker)


# ---------------------------------------------------------------------------------------------------- start-up
def test_busy_port_stops_train_py_before_any_model_loads(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, marker = train(f"server.port={port}", f"hydra.run.dir={tmp_path}/run", timeout=120)
    assert code != 0
    assert f"server.port={port} on 127.0.0.1 is already in use" in out
    assert "ConfigError" in out
    # Nothing started: no server log, no metrics, no checkpoints.
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert processes_with_marker(marker) == []


def test_low_disk_is_a_clear_error(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from grpo.config import ConfigError
    from grpo.config.run_dir import check_run_dir

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 1024**3, 10 * 1024**3 - 50 * 1024**2, 50 * 1024**2))
    with pytest.raises(ConfigError, match="only 50 MiB free"):
        check_run_dir(tmp_path / "run")


# ---------------------------------------------------------------------------------------------------- Atropos input
def _loss_is_finite(groups: list[dict], missing: int) -> None:
    """prepare_batch counts `missing` sequences without log-probs and the GRPO loss over them stays finite."""
    from grpo.pipeline.batching import prepare_batch
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.loss_interface import LossInputs

    batch = prepare_batch(groups, advantage_norm="group", max_seq_len=64, micro_batch_size=8, pad_token_id=0,
                          vocab_size=300)
    assert batch.metrics["data/missing_logprobs"] == missing
    for mb in batch.micro_batches:
        logprobs = torch.full(mb.loss_mask.shape, -1.0)
        loss, m = GRPOLoss(clip_eps=0.2)(LossInputs(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask))
        assert torch.isfinite(loss) and all(torch.isfinite(torch.as_tensor(v)) for v in m.values())


def test_null_logprobs_and_empty_group_through_run_api(tmp_path):
    """Bad inputs tests/test_atropos_pipeline.py does not push through run-api. Null inference_logprobs: kept,
    trained as on-policy, counted. An empty group: run-api 0.4.0 accepts it but never puts it in a batch; the
    trainer gets the rest intact. A null row inside inference_logprobs: run-api refuses it (422)."""
    import requests

    from grpo.pipeline.atropos import AtroposPipeline
    from test_atropos_pipeline import BATCH, _ctx, _group, _push, _register_env, _start_run_api, _stop

    proc, url = _start_run_api(tmp_path)
    try:
        pipe = AtroposPipeline(url=url, poll_interval_s=0.05, max_wait_s=5, max_retries=2)
        pipe.setup(_ctx(tmp_path))
        assert requests.get(url + "/batch", timeout=5).json() == {"batch": None}
        env_id = _register_env(url)
        null_field, good = {**_group(1), "inference_logprobs": None}, _group(2)
        null_row = requests.post(url + "/scored_data", json={**_group(5), "inference_logprobs": [None] * 4}, timeout=5)
        assert null_row.status_code == 422
        _push(url, {**_group(3), "tokens": [], "masks": [], "scores": []}, None)
        _push(url, null_field, env_id)
        _push(url, good, env_id)
        groups = pipe.next_groups(0)
        assert sum(len(g.tokens) for g in groups) == BATCH
        assert sorted(g.scores for g in groups) == [null_field["scores"], good["scores"]]
        assert [all(r is None for r in g.inference_logprobs) for g in groups].count(True) == 1
        _loss_is_finite(groups, missing=4)
    finally:
        _stop(proc)


def test_malformed_json_mid_run_empty_group_and_null_rows_from_a_bad_server(tmp_path):
    """A server speaking run-api's protocol that answers /batch with a non-JSON body once, then a batch holding an
    empty group, a group with a null log-prob row and a good group: one retry, the empty group dropped and
    counted, the null row trained as on-policy."""
    import http.server
    import threading

    from grpo.pipeline.atropos import AtroposPipeline
    from test_atropos_pipeline import BATCH, _ctx, _group

    null_row = _group(1)
    null_row["inference_logprobs"][2] = None
    answers = [b"{\"batch\": [tru", json.dumps({"batch": [{"tokens": [], "masks": [], "scores": []}, null_row,
                                                         _group(2)]}).encode()]

    class Bad(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            if self.path == "/info":
                body = json.dumps({"batch_size": BATCH, "max_token_len": 64}).encode()
            elif self.path == "/batch":
                body = answers.pop(0) if answers else b'{"batch": null}'
            else:
                body = b'{"status": "success", "uuid": 1}'
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bad)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pipe = AtroposPipeline(url=f"http://127.0.0.1:{server.server_address[1]}", poll_interval_s=0.02, max_wait_s=5,
                               max_retries=2)
        pipe.setup(_ctx(tmp_path))
        groups = pipe.next_groups(0)
        m = pipe.metrics()
        assert (m["data/retries"], m["data/dropped_malformed"], m["data/groups"]) == (1, 1, 2)
        assert groups[0].scores == null_row["scores"]
        _loss_is_finite(groups, missing=1)
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------------- soak
@pytest.mark.vllm
@pytest.mark.slow
def test_soak_200_steps_with_a_server_crash_every_50(tmp_path, tiny_qwen2_dir):
    """200 steps; the server is SIGKILLed at steps 50, 100 and 150 and restarted. No step lost, no growth in the
    trainer's RSS or open file descriptors (read from /proc/self every step). ~15 min on 2 loaded CPU cores."""
    run = tmp_path / "run"
    code, out, marker = train("train.steps=200", "train.checkpoint_every=50", "server.max_restarts=3",
                              f"server.port={free_port()}", f"hydra.run.dir={run}", fault="kill_server@50,100,150",
                              timeout=3600)
    assert code == 0, out[-3000:]
    assert_clean(marker)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 201))
    assert "restart 3 of 3" in out
    starts = server_starts(run)
    assert len(starts) == 4 and all("/served_weights/v" in s for s in starts[1:])
    rss = [r["memory/rss_gb"] for r in rows]
    fds = [r["proc/open_fds"] for r in rows]
    early, late = sorted(rss[20:50])[15], sorted(rss[170:200])[15]  # medians after warm-up and at the end
    report = {"rss_gb_step20_50_median": early, "rss_gb_step170_200_median": late, "rss_gb_max": max(rss),
              "fds_step20_50_max": max(fds[20:50]), "fds_step170_200_max": max(fds[170:200]), "fds_max": max(fds),
              "step_seconds_median": sorted(r["time/step_seconds"] for r in rows)[100]}
    (tmp_path / "soak.json").write_text(json.dumps(report, indent=2))
    print("soak:", json.dumps(report))
    assert late - early < 0.05 + 0.05 * early, report  # < 50 MB + 5 %
    assert max(fds[170:200]) <= max(fds[20:50]) + 2, report
    assert_valid_checkpoint(run, 200, tiny_qwen2_dir)


@pytest.mark.vllm
def test_a_server_stopped_during_its_start_up_is_gone_in_seconds(tiny_qwen2_dir, tmp_path, caplog):
    """vLLM ignores SIGTERM while it starts: a Ctrl-C during the start-up waited the full 20 s grace in silence
    (measured 21.5 s) before the SIGKILL. A server that never answered /health is killed after 2 s."""
    import contextlib
    import logging
    import threading

    from grpo.inference.process import STARTING_STOP_S, ServerStartError, VLLMServer

    server = VLLMServer(tiny_qwen2_dir, server_cfg(kv_cache_gb=0.25), tmp_path / "vllm.log")

    def start() -> None:
        with contextlib.suppress(ServerStartError):  # its process is gone: what the stop below causes
            server.start(timeout=20)

    threading.Thread(target=start, daemon=True).start()
    deadline = time.monotonic() + 30  # until vLLM is past its first log lines and into its engine's start-up
    while time.monotonic() < deadline and "Resolved architecture" not in server.log_tail(40):
        time.sleep(0.2)
    time.sleep(3)
    assert not server.ready
    assert server.stop_grace(20.0) == STARTING_STOP_S < 20.0
    pid = server.proc.pid
    with caplog.at_level(logging.INFO, logger="grpo.inference.process"):
        server.stop()
    # The stop said which grace it waited (vLLM ignores the SIGTERM here, so it always waits past the first second).
    assert f"waiting up to {STARTING_STOP_S:.0f} s for it to exit, then SIGKILL" in caplog.text
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole process group is gone


# ---------------------------------------------------------------------------------------- a run dir turned read-only
def _set_immutable(paths: list[Path], on: bool) -> None:
    """chattr +i / -i: a directory no process can add entries to or remove them from, root included (a read-only
    mount without mounting; chmod binds no root process)."""
    for path in paths:
        subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True, capture_output=True)


def _can_set_immutable(tmp_path: Path) -> bool:
    import shutil

    probe = tmp_path / "immutable_probe"
    probe.mkdir()
    try:
        if shutil.which("chattr") is None:
            return False
        _set_immutable([probe], True)
    except subprocess.CalledProcessError:
        return False
    try:
        (probe / "x").touch()
        return False
    except OSError:
        return True
    finally:
        _set_immutable([probe], False)


@pytest.mark.slow  # a vLLM start of its own (the teardown stops it): 40-90 s here
@pytest.mark.vllm
def test_a_run_dir_turned_read_only_mid_run_reports_its_first_error_and_stops_its_server(tmp_path):
    """Issue 62.6: the run showed only the teardown's OSError on logs/vllm.pid; the first error (the served weights
    that could not be written) was shown nowhere. The run dir, logs/ and served_weights/ become read-only once the
    first sync is served: the next sync's WeightsWriteError is the error the run ends with, the summary is attempted
    (and said to be unwritable), the pid file that cannot be removed is said so, and the server is stopped."""
    if not _can_set_immutable(tmp_path):
        pytest.skip("needs chattr +i on this filesystem (root on ext4)")
    run = tmp_path / "run"
    proc, marker = start_train("train.steps=400", "train.checkpoint_every=1000", f"hydra.run.dir={run}")
    frozen: list[Path] = []
    try:
        deadline = time.time() + 300
        while not (run / "served_weights" / "v1").is_dir() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        frozen = [run, run / "logs", run / "served_weights"]
        _set_immutable(frozen, True)
        out, _ = proc.communicate(timeout=300)
    finally:
        _set_immutable(frozen, False)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out[-3000:]
    raised = [line for line in out.splitlines() if re.match(r"[\w.]+(Error|Exception): ", line)]
    assert re.fullmatch(r"\S*WeightsWriteError: \[Errno 1\] could not write weights to \S*/served_weights/v\d+: .*",
                        raised[-1]), out[-3000:]  # the error the run ends with: the first one
    assert "vllm.pid" not in "\n".join(raised), out[-3000:]
    assert re.search(r"could not write \S*summary\.json \(status failed\)", out), out[-3000:]
    assert re.search(r"vLLM stopped, but its pid file \S*vllm\.pid could not be removed", out), out[-3000:]
    assert_clean(marker)


class _Part:
    """A part of a run whose close is recorded, and raises `error` when given."""

    def __init__(self, name: str, closed: list[str], error: Exception | None = None) -> None:
        self.name, self.closed, self.error = name, closed, error

    def close(self) -> None:
        self.closed.append(self.name)
        if self.error is not None:
            raise self.error

    def shutdown(self, keep: bool = False) -> None:
        self.close()


def test_teardown_errors_after_the_runs_own_error_are_secondary_and_every_part_is_closed(caplog):
    """Issue 62.6: a teardown error (the pid file of a read-only run dir) replaced the run's first error. Each part
    is closed whatever the others do; after the run's own error the teardown's are logged as secondary and noted on
    it; without one the first teardown error is raised once every part is closed."""
    import logging

    from grpo.build import RunParts

    def parts(closed: list[str]) -> RunParts:
        return RunParts(cfg=None, run_dir=Path("."), dist=None, device=torch.device("cpu"), model_dir="", tokenizer=None,
                        resume=None, sync=None, sync_ctx=None, server=_Part("server", closed, OSError("pid file")), loss_fn=None,
                        data=_Part("data", closed), evaluator=None, trainer=_Part("trainer", closed),
                        metrics=_Part("metrics", closed, PermissionError("metrics file")))

    closed: list[str] = []
    first = RuntimeError("could not write weights to served_weights/v8")
    with caplog.at_level(logging.ERROR, logger="grpo.build"):
        parts(closed).close(failed=first)  # raises nothing: the caller raises `first`
    assert closed == ["metrics", "data", "trainer", "server"]
    assert "PermissionError: metrics file (secondary: the run's error is the RuntimeError)" in caplog.text
    assert [n for n in first.__notes__ if "pid file" in n]
    closed.clear()
    with pytest.raises(PermissionError, match="metrics file"):
        parts(closed).close()
    assert closed == ["metrics", "data", "trainer", "server"]

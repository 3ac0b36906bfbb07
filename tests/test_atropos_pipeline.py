"""data=atropos against the real `run-api` (atroposlib 0.4.0) started on 127.0.0.1 for this module."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import free_port
from grpo.inference.client import Endpoint
from grpo.pipeline.atropos import AtroposError, AtroposPipeline, AtroposTimeoutError
from grpo.pipeline.base import PipelineContext
from grpo.pipeline.generation import GenerationHandle

GROUP_SIZE = 4
BATCH = 8  # sequences per step = 2 groups


def _run_api_cmd(port: int) -> list[str]:
    run_api = Path(sys.executable).parent / "run-api"
    return [str(run_api), "--host", "127.0.0.1", "--port", str(port)]


def _start_run_api(tmp_path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """run-api in its own process group; returns once /status answers."""
    port = port or free_port()
    with open(tmp_path / "run-api.log", "wb") as log:
        proc = subprocess.Popen(_run_api_cmd(port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            requests.get(url + "/status", timeout=1).raise_for_status()
            return proc, url
        except requests.RequestException:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError("run-api did not start: " + (tmp_path / "run-api.log").read_text()[-2000:])
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture()
def run_api(tmp_path):
    """A fresh run-api per test (its state is process-global)."""
    proc, url = _start_run_api(tmp_path)
    yield url
    _stop(proc)


class _Tok:
    """Just enough tokenizer for the pipeline: its size bounds the token ids."""

    def __len__(self) -> int:
        return 300


def _ctx(tmp_path, max_seq_len=64, start_step=0, version=lambda: 0, max_staleness=0) -> PipelineContext:
    return PipelineContext(
        tokenizer=_Tok(),
        generation=GenerationHandle(lambda: Endpoint("http://unused", None, version())), batch_size=BATCH,
        max_seq_len=max_seq_len, run_dir=tmp_path, total_steps=10, start_step=start_step, checkpoint_every=5, seed=0,
        max_staleness=max_staleness,
    )


def _group(seed: int, prompt_len=5, completion_len=4) -> dict:
    """An Atropos-shaped group as an environment would push it."""
    tokens, masks, lps = [], [], []
    for i in range(GROUP_SIZE):
        prompt = [(seed * 7 + j) % 250 + 1 for j in range(prompt_len)]
        completion = [(seed + i + j) % 250 + 1 for j in range(completion_len)]
        tokens.append(prompt + completion)
        masks.append([-100] * prompt_len + completion)
        lps.append([1.0] * prompt_len + [-0.5 - 0.1 * j for j in range(completion_len)])
    return {
        "tokens": tokens, "masks": masks, "scores": [float(i) / GROUP_SIZE + seed for i in range(GROUP_SIZE)],
        "inference_logprobs": lps, "generation_params": {"temperature": 0.9},
    }


def _register_env(url: str) -> int:
    body = {"max_token_length": 64, "desired_name": "test_env", "weight": 1.0, "group_size": GROUP_SIZE}
    answer = requests.post(url + "/register-env", json=body, timeout=5).json()
    assert answer["status"] == "success", answer
    return answer["env_id"]


def _push(url: str, group: dict, env_id: int | None) -> None:
    requests.post(url + "/scored_data", json={**group, "env_id": env_id}, timeout=5).raise_for_status()


def _status(url: str) -> dict:
    return requests.get(url + "/status", timeout=5).json()


def test_consumes_pushed_groups_and_step_advances(run_api, tmp_path):
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=5, max_retries=2)
    pipe.setup(_ctx(tmp_path, start_step=3))
    info = requests.get(run_api + "/info", timeout=5).json()
    assert info == {"batch_size": BATCH, "max_token_len": 64}
    assert _status(run_api)["current_step"] == 3

    # As an environment would: wait until the trainer's first /batch lets it register, then push.
    pushed = [_group(s) for s in range(6)]  # 3 steps of 2 groups
    env: dict = {}

    def environment():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            body = {"max_token_length": 64, "desired_name": "test_env", "weight": 1.0, "group_size": GROUP_SIZE}
            answer = requests.post(run_api + "/register-env", json=body, timeout=5).json()
            if answer["status"] == "success":
                env["id"] = answer["env_id"]
                for g in pushed[:2]:
                    _push(run_api, g, env["id"])
                return
            time.sleep(0.05)

    thread = threading.Thread(target=environment)
    thread.start()
    received = []
    for step in range(3, 6):
        if step > 3:  # one step's worth at a time, so each /batch hands out exactly one batch
            for g in pushed[2 * (step - 3): 2 * (step - 2)]:
                _push(run_api, g, env["id"])
        groups = pipe.next_groups(step)
        assert sum(len(g.tokens) for g in groups) == BATCH
        assert pipe.last_metrics["data/dropped_malformed"] == 0
        received.extend(groups)
        assert _status(run_api)["current_step"] == step + 1
    assert sorted(g.scores for g in received) == sorted(p["scores"] for p in pushed)
    for got in received:
        want = next(p for p in pushed if p["scores"] == got.scores)
        for field in ("tokens", "masks", "inference_logprobs"):
            assert getattr(got, field) == want[field], field
        assert got.temperatures == [want["generation_params"]["temperature"]] * len(got)
        assert got.env_id == env["id"]
    thread.join()
    assert pipe.state_dict() == {"step": 5}
    assert pipe.last_metrics["data/polls"] == 1 and pipe.last_metrics["data/retries"] == 0
    pipe.close()
    pipe.close()


def test_bad_groups_are_dropped_and_counted(run_api, tmp_path):
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=5, max_retries=2)
    pipe.setup(_ctx(tmp_path, max_seq_len=16))
    assert requests.get(run_api + "/batch", timeout=5).json() == {"batch": None}  # trainer started
    env_id = _register_env(run_api)

    too_long = _group(1, prompt_len=10, completion_len=10)  # 20 tokens > 16
    wrong_mask = _group(2)
    wrong_mask["masks"][1] = wrong_mask["masks"][1][:-1]
    bad_logprobs = _group(3)
    bad_logprobs["inference_logprobs"][0] = [1.0]
    out_of_vocab = _group(4)
    out_of_vocab["tokens"][0][-1] = out_of_vocab["masks"][0][-1] = 100_000
    bad_temperature = _group(5)
    bad_temperature["generation_params"] = {"temperature": -1.0}
    good = _group(6)
    # run-api cuts the queue into batches of 2 groups and hands the newest batch out first: the first two /batch
    # answers hold only bad groups (the pipeline keeps polling), the third holds `good` and `too_long`.
    for g in (good, too_long, wrong_mask, bad_logprobs, out_of_vocab, bad_temperature):
        _push(run_api, g, env_id)
    groups = pipe.next_groups(0)
    assert [g.scores for g in groups] == [good["scores"]]
    m = pipe.metrics()
    assert m["data/dropped_too_long"] == 1
    assert m["data/dropped_malformed"] == 4
    assert m["data/polls"] == 3
    assert pipe.totals == {"data/dropped_malformed": 4, "data/dropped_too_long": 1, "async/dropped_groups": 0}
    assert m["async/unversioned_groups"] == 1 and "async/staleness_mean" not in m  # no group says its version


def test_numbers_past_float32_and_a_string_override_are_dropped_and_counted(run_api, tmp_path, caplog):
    """Values run-api passes on that the trainer could not hold. Before: a score of 1e200 overflowed its group's
    spread and the group trained with zero advantage, counted as an ordinary zero-advantage group; an advantage past
    float32 stopped the run in the batcher ('RuntimeError: value cannot be converted to type float without
    overflow'); log-probs past it became -inf; set_advantage_to_zero "false" was taken as true. Now each such group
    is dropped and counted, with the field named."""
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=5, max_retries=2)
    pipe.setup(_ctx(tmp_path))
    assert requests.get(run_api + "/batch", timeout=5).json() == {"batch": None}
    env_id = _register_env(run_api)
    huge_score = _group(1)
    huge_score["scores"][0] = 1e200
    huge_advantage = {**_group(2), "advantages": [[1e39] * 9] * GROUP_SIZE}
    huge_logprob = _group(3)
    huge_logprob["inference_logprobs"][1][-1] = -1e39
    huge_ref = {**_group(4), "ref_logprobs": [[-1e39] * 9] * GROUP_SIZE}
    string_override = {**_group(5), "overrides": [{"set_advantage_to_zero": "false"}] * GROUP_SIZE}
    good = _group(6)
    # Batches of 2 groups, the newest first (test_bad_groups_are_dropped_and_counted): good comes with huge_score.
    for g in (good, huge_score, huge_advantage, huge_logprob, huge_ref, string_override):
        _push(run_api, g, env_id)
    with caplog.at_level(logging.WARNING, logger="grpo.pipeline.atropos"):
        groups = pipe.next_groups(0)
    messages = [r.getMessage() for r in caplog.records]
    assert [g.scores for g in groups] == [good["scores"]]
    assert pipe.metrics()["data/dropped_malformed"] == 5 and pipe.metrics()["data/polls"] == 3
    for field in ("scores: has 1e+200", "advantages: sequence 0", "inference_logprobs: sequence 1 has -1e+39",
                  "ref_logprobs: sequence 0 has -1e+39", "overrides: sequence 0: set_advantage_to_zero must be"):
        assert any(field in m for m in messages), (field, messages)


def test_a_batch_run_api_cannot_send_is_counted_and_said(run_api, tmp_path, caplog):
    """run-api 0.4.0 accepts a score of inf (or NaN), then answers 500 to the /batch that holds it, after taking the
    batch off its queue: that batch (a good group with it) is gone. Before, the pipeline retried in silence (a
    timeout said '0 bad groups dropped'); now it warns and counts it (data/batch_server_errors) and goes on."""
    import json

    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=10, max_retries=2)
    pipe.setup(_ctx(tmp_path))
    assert requests.get(run_api + "/batch", timeout=5).json() == {"batch": None}
    env_id = _register_env(run_api)
    poisoned = _group(1)
    poisoned["scores"][0] = float("inf")  # json.dumps writes Infinity; run-api's parser takes it
    for g in (poisoned, _group(2)):
        requests.post(run_api + "/scored_data", data=json.dumps({**g, "env_id": env_id}),
                      headers={"Content-Type": "application/json"}, timeout=5).raise_for_status()

    def environment():  # pushes the next batch once run-api has lost the first
        deadline = time.monotonic() + 10
        while _status(run_api)["current_step"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        for g in (_group(3), _group(4)):
            _push(run_api, g, env_id)

    thread = threading.Thread(target=environment)
    thread.start()
    with caplog.at_level(logging.WARNING, logger="grpo.pipeline.atropos"):
        groups = pipe.next_groups(0)
    thread.join()
    assert sorted(g.scores for g in groups) == sorted([_group(3)["scores"], _group(4)["scores"]])
    assert pipe.last_metrics["data/batch_server_errors"] == 1
    assert "the batch it was sending is likely lost" in caplog.text and "HTTP 500" in caplog.text


def _versioned(seed: int, version: int | None, last: int | None = None) -> dict:
    """A group whose environment reported the weight version it sampled under (in generation_params, the one place
    run-api keeps it), as grpo.tasks.atropos_env sends it."""
    group = _group(seed)
    if version is not None:
        group["generation_params"] = {"temperature": 0.9, "weight_version": version,
                                      "last_weight_version": version if last is None else last}
    return group


def test_lag_is_reported_and_groups_older_than_max_staleness_dropped(run_api, tmp_path):
    trainer_version = 5
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=5, max_retries=2)
    pipe.setup(_ctx(tmp_path, version=lambda: trainer_version, max_staleness=2))
    assert requests.get(run_api + "/batch", timeout=5).json() == {"batch": None}  # trainer started
    env_id = _register_env(run_api)

    # Lags 0 and 1 (a sync landed while the second was generated: its last token is at version 5).
    for g in (_versioned(1, 5), _versioned(2, 4, last=5)):
        _push(run_api, g, env_id)
    groups = pipe.next_groups(0)
    assert [g.weight_version for g in groups] == [5, 4] and groups[1].last_weight_version == 5
    m = pipe.metrics()
    assert (m["async/staleness_mean"], m["async/staleness_max"]) == (0.5, 1.0)
    assert m["async/mid_sync_groups"] == 1 and m["async/dropped_groups"] == 0 and m["async/unversioned_groups"] == 0

    # Lag 4 > 2 is dropped; a group without a version has no known lag and is kept (counted).
    for g in (_versioned(3, 1), _versioned(4, None)):
        _push(run_api, g, env_id)
    groups = pipe.next_groups(1)
    assert [g.scores for g in groups] == [_group(4)["scores"]]
    m = pipe.metrics()
    assert m["async/dropped_groups"] == 1 and m["async/unversioned_groups"] == 1 and "async/staleness_max" not in m

    # A batch with only stale groups is skipped (the pipeline asks again at once); the trainer moved to version 7.
    trainer_version = 7
    for g in (_versioned(5, 7), _versioned(6, 6), _versioned(7, 3), _versioned(8, 4)):
        _push(run_api, g, env_id)
    groups = pipe.next_groups(2)
    assert [g.weight_version for g in groups] == [7, 6]
    m = pipe.metrics()
    assert m["async/dropped_groups"] == 2 and m["data/polls"] == 2 and m["async/dropped_groups_total"] == 3
    assert (m["async/staleness_mean"], m["async/staleness_max"]) == (0.5, 1.0)
    assert pipe.totals["async/dropped_groups"] == 3


def test_no_staleness_limit_at_zero_keeps_old_groups(run_api, tmp_path):
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=5, max_retries=2)
    pipe.setup(_ctx(tmp_path, version=lambda: 50, max_staleness=0))
    assert requests.get(run_api + "/batch", timeout=5).json() == {"batch": None}
    env_id = _register_env(run_api)
    for g in (_versioned(1, 0), _versioned(2, 49)):
        _push(run_api, g, env_id)
    assert len(pipe.next_groups(0)) == 2
    assert pipe.metrics()["async/staleness_max"] == 50 and pipe.metrics()["async/dropped_groups"] == 0


def test_group_validation_on_shapes_the_server_accepts(tmp_path):
    from grpo.pipeline.atropos import MalformedGroup, validate_group

    validate_group(_group(0))
    validate_group({**_group(0), "inference_logprobs": None, "advantages": [0.1, 0.2, 0.3, 0.4]})
    bad = [
        [], "x", {"tokens": [], "masks": [], "scores": []}, {"masks": [[1]], "scores": [0.0]},
        {**_group(0), "scores": [1.0, 2.0]}, {**_group(0), "scores": [float("nan")] * 4},
        {**_group(0), "tokens": [[True, 2], [1, 2], [1, 2], [1, 2]]},
        {**_group(0), "masks": [[-100] * 9, [-100] * 9, [-100] * 9, [7] * 9]},  # mask id differs from the token
        {**_group(0), "advantages": [[0.0], [0.0], [0.0], [0.0]]},
        {**_group(0), "overrides": [{"temperature": 0}] * 4},
        {**_group(0), "generation_params": {"temperature": 0.9, "weight_version": -1}},
        {**_group(0), "generation_params": {"weight_version": 3, "last_weight_version": 2}},
        {**_group(0), "weight_version": "3"},
    ]
    for g in bad:
        with pytest.raises(MalformedGroup):
            validate_group(g)


def test_timeout_when_no_data(run_api, tmp_path):
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=1.0, max_retries=1)
    pipe.setup(_ctx(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=run_api):
        pipe.next_groups(0)
    # Back-off is capped at 8x the poll interval, so the wait overshoots max_wait_s by at most one short sleep.
    assert 1.0 <= time.monotonic() - t0 < 3.0


def test_groups_that_make_no_batch_time_out_saying_so(run_api, tmp_path):
    """An environment with group_size 3: its groups never add up to a batch of 8, so run-api keeps them queued and
    answers no batch. Before, the timeout asked whether an environment was running, while one was pushing."""
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=0.5, max_retries=1)
    pipe.setup(_ctx(tmp_path))
    assert requests.get(run_api + "/batch", timeout=5).json() == {"batch": None}
    body = {"max_token_length": 64, "desired_name": "threes", "weight": 1.0, "group_size": 3}
    env_id = requests.post(run_api + "/register-env", json=body, timeout=5).json()["env_id"]
    for seed in range(3):
        group = _group(seed)
        _push(run_api, {k: v[:3] if isinstance(v, list) else v for k, v in group.items()}, env_id)
    with pytest.raises(AtroposTimeoutError, match=r"run-api holds 3 queued groups that make no batch of exactly 8 "
                                                  r"sequences: .* must divide 8"):
        pipe.next_groups(0)


def test_dead_url_gives_bounded_retries_then_clear_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    pipe = AtroposPipeline(url=url, poll_interval_s=0.05, max_wait_s=5, max_retries=3)
    t0 = time.monotonic()
    with pytest.raises(AtroposError, match=f"{url}.*4 attempts") as e:
        pipe.setup(_ctx(tmp_path))
    assert "run-api" in str(e.value)
    # 3 retries with back-off 0.05, 0.1, 0.2 s.
    assert time.monotonic() - t0 < 3.0


def test_a_run_without_run_api_stops_before_its_server_starts_with_what_to_start(tmp_path):
    """`python train.py data=atropos` with nothing at data.url: the preflight stops it in seconds, before vLLM's
    start-up (~25 s here), with a message that names the URL and what to start, and no traceback."""
    from conftest import REPO

    url = f"http://127.0.0.1:{free_port()}"
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = subprocess.run(
        # '~experiment': the bare tiny model, so a fresh cache does not build the default job's warm start first.
        [sys.executable, str(REPO / "train.py"), "~experiment", "data=atropos", f"data.url={url}", "data.max_retries=1",
         "data.poll_interval_s=0.05", "train.steps=1", f"hydra.run.dir={run}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"AtroposError: run-api GET {url}/status failed after 2 attempts" in out.stderr
    assert "Start Atropos' run-api first" in out.stderr and "Traceback" not in out.stderr
    assert not (run / "logs" / "vllm.log").exists()  # no inference server was started
    assert time.monotonic() - t0 < 60


def test_server_answering_garbage(tmp_path):
    """A server that answers HTML / 500s: bounded retries, then an error naming the URL."""
    import http.server

    class Garbage(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            hits.append(self.path)
            # Two 500s, then 200s whose body is not JSON.
            code = 500 if len(hits) <= 2 else 200
            body = b"<html>not json</html>"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    hits: list[int] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        pipe = AtroposPipeline(url=url, poll_interval_s=0.02, max_wait_s=5, max_retries=4)
        with pytest.raises(AtroposError, match="malformed JSON") as e:
            pipe.setup(_ctx(tmp_path))
        assert url in str(e.value)
        assert len(hits) == 5  # 1 try + 4 retries
    finally:
        server.shutdown()
        server.server_close()


def test_data_before_register_is_a_clear_error(run_api, tmp_path):
    """atroposlib 0.4.0 quirk: data queued before /register leaves the trainer state uninitialised."""
    _push(run_api, _group(0), None)
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=2, max_retries=1)
    with pytest.raises(AtroposError, match="before the trainer registered"):
        pipe.setup(_ctx(tmp_path))


def test_run_api_going_away_mid_run(tmp_path):
    proc, url = _start_run_api(tmp_path)
    try:
        pipe = AtroposPipeline(url=url, poll_interval_s=0.05, max_wait_s=30, max_retries=3)
        pipe.setup(_ctx(tmp_path))
        _stop(proc)
        t0 = time.monotonic()
        with pytest.raises(AtroposError, match=f"{url}/batch failed after 4 attempts"):
            pipe.next_groups(0)
        assert time.monotonic() - t0 < 3.0  # bounded by the retries, not by max_wait_s
    finally:
        _stop(proc)


def test_restarted_run_api_gets_registered_again(tmp_path):
    proc, url = _start_run_api(tmp_path)
    try:
        pipe = AtroposPipeline(url=url, poll_interval_s=0.05, max_wait_s=0.5, max_retries=3)
        pipe.setup(_ctx(tmp_path))
        _stop(proc)
        proc, _ = _start_run_api(tmp_path, port=int(url.rsplit(":", 1)[1]))
        assert requests.get(url + "/info", timeout=5).json()["batch_size"] == -1
        # The new server answers "Trainer not registered": the pipeline registers again and keeps polling.
        with pytest.raises(TimeoutError):
            pipe.next_groups(0)
        assert requests.get(url + "/info", timeout=5).json()["batch_size"] == BATCH
    finally:
        _stop(proc)


def test_a_run_api_restarted_mid_run_is_registered_again_at_the_trainer_step_and_counted(tmp_path):
    """run-api killed after two batches and started again on its port: the trainer registers again at the step it is
    at (run-api's step, which environments read from /status, went back to the run's first step before), counts it
    (data/reregistrations) and trains on what the environment pushes to the new server."""
    proc, url = _start_run_api(tmp_path)
    try:
        pipe = AtroposPipeline(url=url, poll_interval_s=0.05, max_wait_s=10, max_retries=3)
        pipe.setup(_ctx(tmp_path))
        assert requests.get(url + "/batch", timeout=5).json() == {"batch": None}
        env_id = _register_env(url)
        for step in (0, 1):
            for g in (_group(2 * step), _group(2 * step + 1)):
                _push(url, g, env_id)
            pipe.next_groups(step)
            assert pipe.last_metrics["data/reregistrations"] == 0
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc, _ = _start_run_api(tmp_path, port=int(url.rsplit(":", 1)[1]))

        def environment():  # registers with the new server once the trainer has polled it, then pushes a batch
            body = {"max_token_length": 64, "desired_name": "test_env", "weight": 1.0, "group_size": GROUP_SIZE}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                answer = requests.post(url + "/register-env", json=body, timeout=5).json()
                if answer["status"] == "success":
                    for g in (_group(10), _group(11)):
                        _push(url, g, answer["env_id"])
                    return
                time.sleep(0.05)

        thread = threading.Thread(target=environment)
        thread.start()
        groups = pipe.next_groups(2)
        thread.join()
        assert sorted(g.scores for g in groups) == sorted([_group(10)["scores"], _group(11)["scores"]])
        assert _status(url)["current_step"] == 3  # registered at step 2, one batch handed out since
        assert pipe.last_metrics["data/reregistrations"] == 1
    finally:
        _stop(proc)


def test_a_long_wait_for_a_batch_says_so_while_it_waits(run_api, tmp_path, caplog, monkeypatch):
    """Before, the trainer said nothing after 'registered with run-api' until data.max_wait_s (10 minutes) ran out,
    e.g. under `python -m grpo.stack --task gsm8k`, whose environment pushes no usable group on a random model."""
    import logging

    from grpo.pipeline import atropos

    monkeypatch.setattr(atropos, "WAIT_REPORT_FIRST_S", 0.2)  # the 30 s of a run, shortened
    pipe = AtroposPipeline(url=run_api, poll_interval_s=0.05, max_wait_s=1.0, max_retries=1)
    pipe.setup(_ctx(tmp_path))
    with caplog.at_level(logging.INFO, logger="grpo.pipeline.atropos"), pytest.raises(AtroposTimeoutError):
        pipe.next_groups(0)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for a batch")]
    assert waits and f"waiting for a batch from run-api at {run_api}: " in waits[0]
    assert "of data.max_wait_s=1; is an environment running and pushing /scored_data?" in waits[0]

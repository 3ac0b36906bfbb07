"""The inference server as a user or an attacker meets it, against the real vLLM CPU engine: a loopback bind and no
open weight endpoints beyond it, reload paths checked before the engine sees them, bounded requests aborted when
their client leaves, string prompts refused by size, /health answering while a large answer is built, the trainer
telling a busy server from a hung one, `logit_bias` / `structured_outputs` served, and a handshake that refuses a
URL that is not a grpo server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from conftest import free_port

TOKEN = "X-GRPO-Token"
MAX_MODEL_LEN = 512  # conftest.server_cfg


def _post(server, path: str, body: dict, timeout: float = 120) -> requests.Response:
    return requests.post(server.url + path, json=body, headers={TOKEN: server.token}, timeout=timeout)


# ---------------------------------------------------------------- item 1: bind, token, reload paths
def _serve(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "grpo.inference.server", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def test_grpo_serve_refuses_a_public_bind_without_a_token(tiny_qwen2_dir):
    """Beyond loopback without GRPO_SERVER_TOKEN, /grpo/pause or /grpo/reload_weights would answer anyone: refused
    before vLLM starts, with what to do."""
    env = {k: v for k, v in os.environ.items() if k != "GRPO_SERVER_TOKEN"}
    proc = _serve(["--model", str(tiny_qwen2_dir), "--host", "0.0.0.0", "--port", str(free_port())], env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-2000:]
    assert "refusing to listen on '0.0.0.0' without GRPO_SERVER_TOKEN" in out and "--host 127.0.0.1" in out, out[-2000:]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


@pytest.mark.slow  # one vLLM start of its own (~30-60 s): grpo-serve as a user types it, no --host
@pytest.mark.vllm
def test_grpo_serve_listens_on_loopback_by_default_and_applies_its_sequence_bound(tiny_qwen2_dir):
    port = free_port()
    env = {**os.environ, "GRPO_SERVER_TOKEN": "t0ken", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = _serve(["--model", str(tiny_qwen2_dir), "--port", str(port), "--max-model-len", "256", "--dtype",
                   "float32", "--kv-cache-memory-bytes", str(2**28), "--enforce-eager", "--no-enable-chunked-prefill",
                   "--distributed-executor-backend", "uni", "--max-sequences-per-request", "8"], env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0
        r = requests.post(url + "/generate", json={"prompts": [[1, 2]] * 3, "n": 3, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and "3 prompt(s) x n=3 = 9 sequences" in r.json()["error"]
        assert "at most 8 sequences per request" in r.json()["error"]
        r = requests.post(url + "/generate", json={"prompts": [[1, 2]] * 4, "n": 2, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["results"]) == 4
        assert requests.get(url + "/grpo/version", timeout=10).json()["max_sequences_per_request"] == 8
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _shape_mismatch_dir(tmp_path: Path, model_dir: Path) -> Path:
    """The served model's config beside a safetensors file whose embedding has another shape."""
    import torch
    from safetensors.torch import save_file

    bad = tmp_path / "bad_shapes"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    save_file({"model.embed_tokens.weight": torch.zeros(3, 5)}, str(bad / "model.safetensors"))
    return bad


@pytest.mark.vllm
def test_reload_of_a_directory_that_is_not_the_served_model_is_400_and_the_engine_lives(
        vllm_server, tiny_qwen2_dir, tiny_llama_dir, tmp_path):
    """`{"path": "/etc"}` passed the old check (a directory) and crashed the engine (worker segfault, then
    EngineDeadError and /health 503)."""
    client = vllm_server.client()
    version = client.weight_version()
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [("/etc", "has no config.json"), (str(empty), "has no config.json"), ("/no/such/dir", "does not exist"),
             (str(tiny_llama_dir), "LlamaForCausalLM"), (str(_shape_mismatch_dir(tmp_path, tiny_qwen2_dir)),
                                                         "of another shape than the served model's")]
    for path, reason in cases:
        r = _post(vllm_server, "/grpo/reload_weights", {"path": path})
        assert r.status_code == 400 and reason in r.json()["error"], (path, r.status_code, r.text)
    assert _post(vllm_server, "/grpo/reload_weights", {"path": str(tiny_qwen2_dir), "weight_version": "x"}
                 ).status_code == 400
    assert client.weight_version() == version
    # ignore_eos: the tiny model samples its end-of-text token now and then, and a short answer is no dead engine.
    r = _post(vllm_server, "/generate", {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["token_ids"][0]) == 3
    # The served model's own directory still reloads.
    assert client.reload_weights(str(tiny_qwen2_dir), version=version)["weight_version"] == version
    client.close()


# ---------------------------------------------------------------- item 2: bounded batches, abort on disconnect
@pytest.mark.vllm
def test_a_batch_beyond_the_sequence_bound_is_400_naming_it(vllm_server):
    """100 prompts x n=100 (10,000 sequences) was served, 130 s on an H100, while every other request waited."""
    r = _post(vllm_server, "/generate", {"prompts": [[1, 2]] * 513, "n": 8, "max_tokens": 2})
    assert r.status_code == 400, r.text[:500]
    assert "513 prompt(s) x n=8 = 4104 sequences: this server serves at most 4096" in r.json()["error"]


def _engine_requests(url: str) -> float:
    """Requests the engine runs or queues now (vLLM's Prometheus gauges)."""
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


@pytest.mark.vllm
def test_a_request_whose_client_disconnects_is_aborted(vllm_server):
    """A client that timed out or was stopped left its sequences generating to the end."""
    body = {"prompts": [[1, 2, 3]] * 32, "n": 8, "max_tokens": 400, "min_tokens": 400, "ignore_eos": True,
            "logprobs": None}
    host, port = vllm_server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.monotonic() + 30
        while _engine_requests(vllm_server.url) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _engine_requests(vllm_server.url) > 0
    t0 = time.monotonic()
    while _engine_requests(vllm_server.url) > 0 and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    left = _engine_requests(vllm_server.url)
    assert left == 0, f"{left:g} requests still in the engine {time.monotonic() - t0:.1f} s after the client left"


# ---------------------------------------------------------------- item 3: string prompts refused by size
@pytest.mark.vllm
def test_a_huge_string_prompt_is_refused_by_its_size_before_tokenizing(vllm_server):
    """A 40 MB string took 51 s of the server's event loop to tokenize (then was refused by its token count): the
    trainer's health check restarted the server meanwhile."""
    t0 = time.monotonic()
    r = _post(vllm_server, "/generate", {"prompt": "ab " * 1_000_000, "max_tokens": 2})
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text[:500]
    assert (f"string prompt of 3000000 characters: at most {32 * MAX_MODEL_LEN} are tokenized"
            in r.json()["error"]), r.text[:500]
    assert took < 5, took
    r = _post(vllm_server, "/generate", {"prompts": ["hello", "x" * (32 * MAX_MODEL_LEN + 1)], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"].startswith("prompts[1]: string prompt of"), r.text[:500]
    assert _post(vllm_server, "/generate", {"prompt": "hello there", "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------- item 4: /health while a large answer is built
@pytest.mark.slow
@pytest.mark.vllm
def test_health_answers_while_a_large_answer_is_built(vllm_server):
    """n=128 long samples with 20 log-probs each stalled /health for 32 s on an H100 (the answer was built and
    serialized on the event loop), and the trainer restarted its server.

    Behind `slow`: a bound on latency depends on the host's load (a 2-core CI host once waited 3.2 s, a garbage
    collection of the API server's whole heap, since frozen: `freeze_startup_heap`); the rendering itself is
    checked beside it without a clock."""
    body = {"prompts": [[1, 2, 3]] * 4, "n": 16, "max_tokens": 300, "min_tokens": 300, "ignore_eos": True,
            "logprobs": 20}
    answer: dict = {}

    def generate() -> None:
        answer["r"] = _post(vllm_server, "/generate", body, timeout=600)

    worker = threading.Thread(target=generate)
    worker.start()
    latencies = []
    while worker.is_alive():
        t0 = time.monotonic()
        assert requests.get(vllm_server.url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    worker.join()
    r = answer["r"]
    assert r.status_code == 200 and len(r.content) > 5e6, (r.status_code, len(r.content))
    assert max(latencies) < 1.5, f"/health took up to {max(latencies):.2f} s ({len(latencies)} asks)"


def test_the_answer_rendered_in_pieces_is_what_starlette_renders_whole():
    """`render_json` dumps a large answer piece by piece (so the event loop gets turns between the pieces); the bytes
    must be exactly the ones Starlette's JSONResponse renders in one call, down to nesting deeper than its pieces."""
    from starlette.responses import JSONResponse

    from grpo.inference.server import render_json

    body = {"text": ["é", "b\"q"], "token_ids": [[1, 2], []], "logprobs": [[[{"5": -0.1, 7: -2.5}]], None],
            "nested": {"a": {"b": {"c": {"d": [1.5, True, None]}}}}, "empty": {}, "weight_version": 3}
    assert render_json(body) == JSONResponse(body).body
    assert render_json([]) == JSONResponse([]).body and render_json("x") == JSONResponse("x").body
    with pytest.raises(ValueError):
        render_json({"x": [float("nan")]})


BUSY_SERVER = r"""
import socket, sys, time
token, port, busy_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen(64)
end = time.monotonic() + busy_s
while time.monotonic() < end:  # busy: every core cycle goes to work, connections wait in the backlog
    sum(range(10000))
while True:
    c = s.accept()[0]
    c.recv(65536)
    c.sendall(b"HTTP/1.1 200 OK\r\nX-GRPO-Token-Verified: true\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    c.close()
"""


class _Weights:
    version = 0

    def __init__(self) -> None:
        self.restored = 0

    def restore_replica(self, replica) -> None:
        self.restored += 1


def _stand_in_server(tmp_path: Path, busy_s: float):
    """A VLLMServer whose process is a stand-in that works `busy_s` seconds without answering, then answers /health
    with the run token's proof (what a server building a large answer on its event loop was)."""
    from conftest import server_cfg
    from grpo.inference.client import InferenceClient
    from grpo.inference.process import VLLMServer
    from grpo.serving.server import InferenceServer, Replica

    process = VLLMServer(tmp_path, server_cfg(), tmp_path / "vllm.log")
    process.proc = subprocess.Popen([sys.executable, "-c", BUSY_SERVER, process.token, str(process.port), str(busy_s)],
                                    start_new_session=True)
    server, weights = InferenceServer(), _Weights()
    server.health_timeout_s, server.busy_grace_s = 1.0, 30.0
    # What `launch` records (the server config and the sync that drives it), as tests/test_serving.py does.
    server._cfg, server._weights = {"max_restarts": 3}, weights
    server.replicas = [Replica(InferenceClient(process.url), process)]
    return server, process, weights


def test_the_trainer_waits_for_a_busy_server_and_restarts_a_stopped_one(tmp_path, caplog):
    server, process, weights = _stand_in_server(tmp_path, busy_s=4.0)
    try:
        time.sleep(0.5)
        assert server.check_health() is False and weights.restored == 0  # busy, then answering: not restarted
        assert "busy: /health did not answer within 1s, yet its API process works; not restarting it" in caplog.text
    finally:
        os.killpg(process.proc.pid, signal.SIGKILL)
        process.proc.wait()
    server, process, weights = _stand_in_server(tmp_path, busy_s=60.0)
    try:
        time.sleep(0.5)
        os.killpg(process.proc.pid, signal.SIGSTOP)  # hung: no CPU however long it is given
        t0 = time.monotonic()
        assert server.check_health() is True and weights.restored == 1
        assert time.monotonic() - t0 < 10
    finally:
        os.killpg(process.proc.pid, signal.SIGKILL)
        process.proc.wait()


# ---------------------------------------------------------------- item 5: logit_bias and structured_outputs
@pytest.mark.vllm
def test_logit_bias_and_structured_outputs_are_served_as_by_v1_completions(vllm_server):
    """Both answered HTTP 500 with an empty message; /v1/completions of the same server serves them."""
    r = _post(vllm_server, "/generate", {"prompt": [1, 2, 3], "max_tokens": 6, "logit_bias": {"7": 100}})
    assert r.status_code == 200 and r.json()["token_ids"] == [[7] * 6], r.text
    r = _post(vllm_server, "/generate", {"prompts": [[1, 2, 3]], "max_tokens": 4, "logit_bias": {"9": 100}})
    assert r.status_code == 200 and r.json()["results"][0]["token_ids"] == [[9] * 4], r.text
    r = _post(vllm_server, "/generate", {"prompt": [1, 2, 3], "max_tokens": 8, "n": 4, "temperature": 1.0,
                                         "structured_outputs": {"choice": ["ab", "ba"]}})
    assert r.status_code == 200 and set(r.json()["text"]) <= {"ab", "ba"}, r.text
    for bad, reason in [({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
                        ({"structured_outputs": {"nope": 1}}, "structured outputs"),
                        ({"structured_outputs": "a+"}, "structured_outputs")]:
        r = _post(vllm_server, "/generate", {"prompt": [1, 2, 3], "max_tokens": 2, **bad})
        assert r.status_code == 400 and reason in r.json()["error"], (bad, r.status_code, r.text)


# ---------------------------------------------------------------- item 9: the handshake
@pytest.fixture()
def health_only_server():
    """A server that answers 200 on /health and 501 on everything else (what a trainer attached to once)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 501)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_an_external_url_that_is_not_a_grpo_server_is_refused_at_start_up(health_only_server, tmp_path):
    from conftest import server_cfg
    from grpo.config_values import ConfigError
    from grpo.serving.server import InferenceServer

    with pytest.raises(ConfigError, match=r"server.external_url=http://127.0.0.1:\d+ answers /health but is not a "
                                          r"grpo server \(.*GET /grpo/version answered HTTP 501"):
        InferenceServer().launch(server_cfg(external_url=health_only_server), _Weights(), model=tmp_path,
                                 run_dir=tmp_path, served_names=[])

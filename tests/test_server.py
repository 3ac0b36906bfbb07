"""The inference server on the real vLLM CPU engine: Atropos' own client against /generate, log-probs vs transformers."""

from __future__ import annotations

import asyncio
import socket

import pytest
import requests
import torch

from conftest import server_cfg


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()


def hf_logprobs(model, tokens: list[int], start: int, temperature: float = 1.0) -> list[float]:
    """Log-prob of tokens[i] given tokens[:i] for i >= start."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp[start - 1 :].tolist()


@pytest.mark.vllm
def test_atropos_vllm_client_against_generate(vllm_server, tiny_qwen2_dir, hf_model):
    """atroposlib's VLLMServer (the client an env with server_type=vllm uses) reads our /generate."""
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer as AtroposVLLM

    cfg = APIServerConfig(
        api_key="x", base_url=vllm_server.url + "/v1", model_name=str(tiny_qwen2_dir), timeout=60, health_check=False
    )
    atropos = AtroposVLLM(cfg)

    async def run():
        out = await atropos.tokens_and_logprobs_completion(prompt="Count: 1 2 3", n=4, max_tokens=12, temperature=1.0)
        lps = await atropos.get_logprobs(prompt="Count: 1 2 3 4", top_k=1)
        return out, lps

    (prompt_tokens, out_tokens, out_logprobs, finish), lps = asyncio.run(run())
    assert len(out_tokens) == len(out_logprobs) == len(finish) == 4
    assert all(r in ("stop", "length") for r in finish)
    diffs = []
    for toks, lps_ in zip(out_tokens, out_logprobs):
        assert len(toks) == len(lps_) > 0
        ref = hf_logprobs(hf_model, prompt_tokens + toks, len(prompt_tokens))
        diffs += [abs(a - b) for a, b in zip(lps_, ref)]
    mad = sum(diffs) / len(diffs)
    print(f"\n/generate (Atropos client) vs transformers log-probs at T=1: mean |diff| = {mad:.2e} over {len(diffs)}")
    assert mad < 1e-4
    # Prompt log-probs path (Atropos get_logprobs): first position has no prefix.
    ids = lps["prompt_tokens"]
    got = [v[0] for v in lps["prompt_topk_logprobs"][1:]]
    ref = hf_logprobs(hf_model, ids, 1)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4


@pytest.mark.vllm
def test_client_generate_and_prompt_logprobs(vllm_server, hf_model):
    from grpo.inference.client import InferenceClient

    client = InferenceClient(vllm_server.url)
    prompts = [[10, 20, 30], [40, 50, 60, 70]]
    res = client.generate(prompts, n=3, max_tokens=8, temperature=1.0)
    assert [len(r) for r in res] == [3, 3]
    c = res[1][0]
    assert len(c.token_ids) == len(c.logprobs) and c.finish_reason in ("stop", "length")
    assert c.weight_version == client.weight_version()
    ref = hf_logprobs(hf_model, prompts[1] + c.token_ids, len(prompts[1]))
    assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4
    seq = [5, 17, 99, 3, 42, 7, 8, 200, 11, 12]
    got = client.prompt_logprobs(seq)
    assert len(got) == len(seq) - 1
    assert max(abs(a - b) for a, b in zip(got, hf_logprobs(hf_model, seq, 1))) < 1e-4


@pytest.mark.vllm
def test_generate_answers_the_same_from_vllms_flat_log_prob_layout(vllm_server):
    """/generate asks vLLM for its flat log-prob layout (cheaper per decode step); the answer, top-k log-probs with the
    actual token first and the prompt's log-probs included, is the one the per-position layout gives."""
    import requests

    body = dict(prompt={"prompt_token_ids": [10, 20, 30, 40]}, n=2, max_tokens=6, temperature=1.0, seed=7, logprobs=2,
                prompt_logprobs=2)  # fmt: skip
    flat, nested = (requests.post(vllm_server.url + "/generate", json={**body, "flat_logprobs": f}, timeout=60).json()
                    for f in (True, False))  # fmt: skip
    for key in ("token_ids", "logprobs", "prompt_logprobs"):
        assert flat[key] == nested[key], key
    for ids, positions in zip(flat["token_ids"], flat["logprobs"]):
        assert [int(next(iter(p[0]))) for p in positions] == ids  # the sampled token is each position's first key
        assert all(2 <= len(p[0]) <= 3 for p in positions)  # the top 2, plus the sampled token when not among them
    assert len(flat["prompt_logprobs"]) == 4


@pytest.mark.vllm
def test_generate_gives_log_probs_unless_asked_for_none(vllm_server):
    """Atropos' clients read log-probs without always asking (absent = 0); an explicit null asks for none, and the
    sampled tokens are the same (seeded) with each sample's "logprobs" null."""
    import requests

    from grpo.inference.client import parse_generate_response

    body = dict(prompt={"prompt_token_ids": [10, 20, 30, 40]}, n=3, max_tokens=6, temperature=1.0, seed=11)
    absent, null = (requests.post(vllm_server.url + "/generate", json={**body, **extra}, timeout=60).json()
                    for extra in ({}, {"logprobs": None}))  # fmt: skip
    assert null["token_ids"] == absent["token_ids"]
    assert null["logprobs"] == [None, None, None]
    assert [len(p) for p in absent["logprobs"]] == [len(t) for t in absent["token_ids"]]
    completions = parse_generate_response(null)
    assert [c.token_ids for c in completions] == absent["token_ids"] and all(c.logprobs is None for c in completions)


@pytest.mark.vllm
def test_seeded_generate_reproduces_and_gives_every_sample_its_own_stream(vllm_server):
    from grpo.inference.client import InferenceClient

    client = InferenceClient(vllm_server.url)
    prompts = [[10, 20, 30]] * 3  # the same prompt three times: only the seeds can tell the samples apart
    kw = dict(n=4, max_tokens=12, temperature=1.0, seed=1234)
    first = [[tuple(c.token_ids) for c in r] for r in client.generate(prompts, **kw)]
    again = [[tuple(c.token_ids) for c in r] for r in client.generate(prompts, **kw)]
    assert first == again  # a saved config re-draws the same rollouts
    samples = [t for r in first for t in r]
    # 12 samples of one prompt from a near-uniform tiny model: with one seed for all prompts, sample k of each prompt
    # drew the same tokens (3 copies of 4 completions); each sample on its own stream makes them all differ.
    assert len(set(samples)) == len(samples)


@pytest.mark.vllm
def test_logprobs_follow_sampling_temperature(vllm_server, hf_model):
    """--logprobs-mode processed_logprobs: the log-probs are those of the distribution sampled from."""
    from grpo.inference.client import InferenceClient

    prompt = [1, 2, 3, 4]
    (cs,) = InferenceClient(vllm_server.url).generate([prompt], n=2, max_tokens=8, temperature=0.7)
    for c in cs:
        ref = hf_logprobs(hf_model, prompt + c.token_ids, len(prompt), temperature=0.7)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4


@pytest.mark.vllm
def test_generate_errors(vllm_server):
    url = vllm_server.url + "/generate"
    r = requests.post(url, json={"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 2, "model": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = requests.post(url, json={"prompt": 3.5})
    assert r.status_code == 400
    r = requests.post(url, json={"prompt": [1, 2], "max_tokens": 2, "no_such_param": 1})
    assert r.status_code == 400
    r = requests.post(vllm_server.url + "/grpo/rpc", json={"method": "execute_model"},
                      headers={"X-GRPO-Token": vllm_server.token})  # the run's token: past the identity check
    assert r.status_code == 403
    # vLLM's own endpoints are untouched.
    assert requests.get(vllm_server.url + "/v1/models").status_code == 200


@pytest.mark.vllm
def test_start_errors_are_clear(tmp_path, tiny_qwen2_dir):
    from grpo.inference.process import ServerStartError, VLLMServer

    with pytest.raises(ServerStartError, match="does not exist"):
        VLLMServer(tmp_path / "missing", server_cfg(), tmp_path / "a.log").start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError, match="already in use"):
            VLLMServer(tiny_qwen2_dir, server_cfg(port), tmp_path / "b.log").start()
    # A bad vLLM argument: the process exits during start-up and the error carries the log tail.
    bad = VLLMServer(tiny_qwen2_dir, server_cfg(), tmp_path / "c.log", extra_args=["--no-such-flag"])
    with pytest.raises(ServerStartError, match="no-such-flag"):
        bad.start(timeout=120)
    assert not bad.running()


@pytest.mark.vllm
def test_busy_loop_cap_reaches_the_vllm_worker(vllm_server):
    # server_cfg sets busy_loop_s=0.02 as conf/server/cpu.yaml does: the plugin must have run in the worker process,
    # where vLLM's shared-memory queue reader spins, not only in the API server.
    import re

    text = vllm_server.log_path.read_text()
    capped = re.findall(r"\(([\w-]+) pid=\d+\).*busy-loop capped at 0\.02 s", text)
    assert any("Worker" in name for name in capped), f"no worker process among {capped}"


def test_busy_loop_plugin_caps_spin_condition_only_when_asked(tmp_path):
    import os
    import subprocess
    import sys

    script = """
import os, zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
reader = SpinCondition(is_reader=True, context=zmq.Context(), notify_address="ipc://{addr}")
from grpo.inference.vllm_plugin import register
register()
reader.wait(timeout_ms=0)  # inside the busy window: yields, then returns
print(reader.busy_loop_s)
"""
    results = {}
    for value in ("0.05", None):
        env = {k: v for k, v in os.environ.items() if k != "GRPO_VLLM_BUSY_LOOP_S"}
        if value:
            env["GRPO_VLLM_BUSY_LOOP_S"] = value
        out = subprocess.run([sys.executable, "-c", script.format(addr=tmp_path / "n")], env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        results[value] = float(out.stdout.split()[-1])
    assert results == {"0.05": 0.05, None: 1.0}


def test_server_environment_carries_the_busy_loop_cap(tmp_path, monkeypatch):
    from grpo.inference.process import VLLMServer

    monkeypatch.setenv("GRPO_VLLM_BUSY_LOOP_S", "7")  # a stray value in the caller's environment is not inherited
    assert VLLMServer(tmp_path, server_cfg(busy_loop_s=0.02), tmp_path / "a.log").environment()["GRPO_VLLM_BUSY_LOOP_S"] == "0.02"
    assert "GRPO_VLLM_BUSY_LOOP_S" not in VLLMServer(tmp_path, server_cfg(busy_loop_s=None), tmp_path / "b.log").environment()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")  # an allow-list keeps our plugin in
    env = VLLMServer(tmp_path, server_cfg(busy_loop_s=0.02), tmp_path / "c.log").environment()
    assert env["VLLM_PLUGINS"] == "lora_filesystem_resolver,grpo_busy_loop"


@pytest.mark.vllm
def _long_request_in_background(client) -> tuple:
    """Start 2 x 480 tokens of one prompt (seconds on the CPU engine) in a thread; returns (thread, out), with
    out["res"] the request's completions once the thread ends."""
    import threading

    out: dict = {}

    def generate() -> None:
        out["res"] = client.generate([[10, 20, 30]], n=2, max_tokens=480, temperature=1.0, ignore_eos=True)

    thread = threading.Thread(target=generate)
    thread.start()
    return thread, out


def _running_requests(base_url: str) -> float:
    """vLLM's own gauge of the requests it is running (GET /metrics)."""
    import requests

    text = requests.get(base_url + "/metrics", timeout=5).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:num_requests_running"))


def _start_and_catch_running(client, attempts: int = 3) -> tuple:
    """The long background request, caught while vLLM runs it (polling its gauge, not a fixed sleep: on a fast or a
    loaded machine a fixed sleep lands before admission or after the end); a fresh request when one was missed."""
    import time

    for _ in range(attempts):
        thread, out = _long_request_in_background(client)
        deadline = time.monotonic() + 30
        while thread.is_alive() and time.monotonic() < deadline:
            if _running_requests(client.base_url) >= 1:
                return thread, out
            time.sleep(0.005)
        thread.join(120)
    raise AssertionError(f"never saw the request running in {attempts} tries")


def test_a_reload_mid_request_shows_in_the_finish_version(vllm_server, tiny_qwen2_dir):
    """/generate reports the weight version at admission and at finish: an in-place reload that lands while a request
    runs makes them differ, and the request is not lost (preempted by the prefix-cache reset, it goes on)."""
    client = vllm_server.client()
    before = client.weight_version()
    thread, out = _start_and_catch_running(client)
    try:
        client.reload_weights(str(tiny_qwen2_dir), version=before + 1)  # the same weights: the session's stay
        thread.join(120)
    finally:
        client.set_weight_version(before)
    completions = out["res"][0]
    assert [len(c.token_ids) for c in completions] == [480, 480]
    assert {(c.weight_version, c.last_weight_version) for c in completions} == {(before, before + 1)}
    again = client.generate([[10, 20, 30]], n=1, max_tokens=4)[0][0]
    assert again.weight_version == again.last_weight_version == before


def _norm_scaled_copy(src, dst, scale: float) -> str:
    """A copy of the model in `src` whose final norm weight is times `scale`, and so are its logits: 1000 makes
    every sampled token's log-prob about 0, 0 makes the distribution exactly uniform."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(src / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * scale
    save_file(weights, dst / "model.safetensors")
    return str(dst)


def _load_in_place(server, path: str) -> None:
    # The worker's in-place reload without /grpo/reload_weights' prefix-cache reset (which preempts the request):
    # the weights change under a running request, as a shared_vllm optimizer step changes them.
    r = requests.post(server.url + "/grpo/rpc", json={"method": "grpo_reload_weights", "kwargs": {"path": path}},
                      headers={"X-GRPO-Token": server.token}, timeout=60)  # fmt: skip
    r.raise_for_status()


def _logprobs_across_a_pause(server, model: str, during: str, after: str, prompt: list[int]) -> list[float]:
    """Stream one 500-token request; once its first token is out, pause, load `during`'s weights, wait, load
    `after`'s, resume. Returns the log-probs of its sampled tokens, in order, once it has finished whole."""
    import json
    import threading
    import time

    out: dict = {"logprobs": [], "finish": None}
    started = threading.Event()

    def stream() -> None:
        body = dict(model=model, prompt=prompt, max_tokens=500, temperature=1.0, ignore_eos=True, stream=True,
                    logprobs=0)  # fmt: skip
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    (choice,) = json.loads(line[6:])["choices"]
                    out["logprobs"] += choice["logprobs"]["token_logprobs"]
                    out["finish"] = choice["finish_reason"] or out["finish"]
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    client = server.client()
    try:
        assert started.wait(60), "the request never started"
        client.pause()
        _load_in_place(server, during)
        time.sleep(0.5)
        _load_in_place(server, after)
    finally:
        client.resume()
        client.close()
    thread.join(120)
    assert not thread.is_alive(), "the request never finished after resume"
    assert (len(out["logprobs"]), out["finish"]) == (500, "length")  # not lost, not cut short
    return out["logprobs"]


def test_keep_pause_freezes_a_running_request_and_resume_finishes_it_whole(vllm_server, tiny_qwen2_dir, tmp_path):
    """shared_vllm and broadcast change the weights while generation is paused ("keep"): no forward pass may run
    until resume, and the request in flight must go on to its full length after it.

    Checked by the weights each token was computed with, not by when tokens arrive: tokens computed before the
    pause can reach the client after it returned (up to 828 of 960, within 21 ms, in a probe over HTTP), which once
    read as "generation went on through the pause". While paused the weights make every sampled token's log-prob
    about 0; from just before resume they make it exactly -log(vocab). A token of the first kind ran while paused."""
    import json
    import math

    peaked = _norm_scaled_copy(tiny_qwen2_dir, tmp_path / "peaked", 1000.0)
    flat = _norm_scaled_copy(tiny_qwen2_dir, tmp_path / "flat", 0.0)
    uniform = -math.log(json.loads((tiny_qwen2_dir / "config.json").read_text())["vocab_size"])
    client = vllm_server.client()
    before = client.weight_version()
    try:
        for attempt in range(3):
            _load_in_place(vllm_server, str(tiny_qwen2_dir))
            lps = _logprobs_across_a_pause(vllm_server, str(tiny_qwen2_dir), peaked, flat, [10, 20, 30 + attempt])
            assert not [lp for lp in lps if lp > -1.0], "tokens were computed while generation was paused"
            # Tokens before the flat tail: computed before the pause.
            n_before = next((i for i in range(len(lps), 0, -1) if abs(lps[i - 1] - uniform) > 1e-4), 0)
            if 0 < n_before < len(lps):
                # It ran before the pause and went on after resume: the check above had a running request to catch.
                print(f"\nkeep pause: {n_before} tokens before it, none while paused, {len(lps) - n_before} after")
                break
        else:
            pytest.fail("the request finished before each pause: make it longer")
    finally:
        client.reload_weights(str(tiny_qwen2_dir), version=before)  # also drops KV computed with the test weights
        client.set_weight_version(before)


@pytest.mark.vllm
def test_batched_generate_gives_the_per_prompt_requests_seeded_samples(vllm_server):
    """The client's batched /generate (all prompts handed to the engine at once) samples exactly what one request per
    prompt (Atropos' form) samples for a seeded call: prompt i seeded base + i * n, sample k base + i * n + k, also
    across requests of a split batch; and the versions of the batch are those of each answer."""
    from grpo.inference.client import InferenceClient

    prompts = [[10, 20, 30], [40, 50, 60, 70], [10, 20, 30], [5, 6]]
    kw = dict(n=3, max_tokens=8, temperature=1.0, seed=77)
    per_prompt, batched, split = (InferenceClient(vllm_server.url, prompts_per_request=size).generate(prompts, **kw)
                                  for size in (0, 64, 3))  # fmt: skip
    tokens = [[[c.token_ids for c in group] for group in run] for run in (per_prompt, batched, split)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert tokens[0][0] != tokens[0][2]  # the same prompt at another index draws from other seeds
    for a, b in zip(per_prompt, batched):
        for x, y in zip(a, b):
            assert x.finish_reason == y.finish_reason and len(y.logprobs) == len(y.token_ids)
            assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) < 1e-4
    version = InferenceClient(vllm_server.url).weight_version()
    assert {(c.weight_version, c.last_weight_version) for group in batched for c in group} == {(version, version)}
    (none,) = InferenceClient(vllm_server.url).generate(prompts[:1], logprobs=False, **kw)
    assert [c.token_ids for c in none] == tokens[0][0] and all(c.logprobs is None for c in none)


@pytest.mark.vllm
def test_batched_generate_answer_and_errors(vllm_server):
    """{"prompts": [...]}: one answer per prompt in order, in the single form's shape, with the batch's versions; a bad
    prompt or key is a 4xx naming it, and nothing of the batch is generated."""
    url = vllm_server.url + "/generate"
    body = {"prompts": [[1, 2, 3], {"prompt_token_ids": [4, 5]}], "n": 2, "max_tokens": 3, "seed": 5}
    r = requests.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [res["prompt_token_ids"] for res in answer["results"]] == [[1, 2, 3], [4, 5]]
    single = requests.post(url, json={"prompt": [4, 5], "n": 2, "max_tokens": 3, "seed": 5 + 1 * 2}, timeout=60).json()
    assert answer["results"][1]["token_ids"] == single["token_ids"]
    assert set(answer["results"][0]) == set(single)  # the same shape, Atropos' keys and the versions
    assert answer["weight_version"] == answer["results"][0]["weight_version"] == single["weight_version"]
    assert answer["last_weight_version"] >= answer["weight_version"]
    for bad, status, reason in [
        ({"prompts": [[1, 2], [1, 10_000_000]], "max_tokens": 2}, 400, "prompts[1]: token id(s) [10000000] out of"),
        ({"prompts": [[1, 2], []], "max_tokens": 2}, 400, "prompts[1]: empty prompt"),
        ({"prompts": [[1, 2], 3.5], "max_tokens": 2}, 400, "prompts[1]: 'prompt' must be"),
        ({"prompts": [], "max_tokens": 2}, 400, "'prompts' must be a non-empty list"),
        ({"prompts": [1, 2], "max_tokens": 2}, 400, "prompts[0]: 'prompt' must be"),
        ({"prompts": [[1, 2]], "prompt": [1, 2]}, 400, "not both"),
        ({"prompts": [[1, 2]], "max_tokens": 0}, 400, "prompts[0]: max_tokens must be >= 1"),
        ({"prompts": [[1, 2]], "seed": "x"}, 400, "seed must be an integer"),
        ({"prompts": [[1, 2]], "no_such_param": 1}, 400, "no_such_param"),
        ({"prompts": [[1, 2]], "model": "nope"}, 404, "nope"),
    ]:
        r = requests.post(url, json=bad, timeout=60)
        assert r.status_code == status and reason in r.json()["error"], (bad, r.status_code, r.text)


@pytest.mark.vllm
def test_a_server_that_does_not_start_ends_the_run_with_one_message(tmp_path):
    """Issue 44.6: two runs on one port: the second failed right, but with three tracebacks (43 frames) around
    ServerStartError: vLLM's own in the logged tail, the launch's, and the tail again in the message. A server that
    does not start now ends the run with its message (naming the cause and the log) and no Python traceback."""
    import json

    from test_train_e2e import assert_clean, run_train

    run_dir = tmp_path / "run"
    out, marker = run_train("~experiment", "server.startup_timeout_s=1", f"hydra.run.dir={run_dir}", timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr, out.stderr[-3000:]
    last = [line for line in out.stderr.splitlines() if line.startswith("ServerStartError: ")]
    assert len(last) == 1 and "not healthy after 1s" in last[0] and str(run_dir / "logs" / "vllm.log") in last[0]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert_clean(marker)


@pytest.mark.slow  # 40-105 s of the CI suite's 25-minute budget: run with `pytest -m slow`
@pytest.mark.vllm
def test_a_second_cpu_server_start_does_not_compile_again_for_a_cache_that_never_loads(tmp_path, tiny_qwen2_dir):
    """Issue 44.17: vLLM 0.32 on CPU saved an AOT compile artifact that its own loader cannot load, so every start
    after the first logged "Compiling model again due to a load failure ... 'function' object has no attribute
    'finalize_loading'" and compiled again. Two starts of one config: the second neither fails a load nor says so."""
    from grpo.inference.process import VLLMServer

    logs = [tmp_path / f"vllm{i}.log" for i in (1, 2)]
    for log in logs:
        server = VLLMServer(tiny_qwen2_dir, server_cfg(), log)  # no LoRA: vLLM compiles the model
        server.start()
        server.stop()
    text = logs[1].read_text()
    assert "Warming up model for the compilation" in text  # the compile path ran
    assert "Compiling model again due to a load failure" not in text
    assert "grpo: VLLM_USE_AOT_COMPILE=0 on CPU" in text


def test_the_engine_start_method_reaches_vllm_and_the_environment_decides_without_it(tmp_path, monkeypatch):
    """server.engine_start_method sets VLLM_WORKER_MULTIPROC_METHOD for the server (over the caller's environment);
    null keeps the environment's, else spawn."""
    from grpo.inference.process import VLLMServer

    def method(value, name):
        cfg = server_cfg(engine_start_method=value)
        return VLLMServer(tmp_path, cfg, tmp_path / f"{name}.log").environment()["VLLM_WORKER_MULTIPROC_METHOD"]

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert (method("fork", "a"), method("spawn", "b"), method(None, "c")) == ("fork", "spawn", "spawn")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert (method(None, "d"), method("spawn", "e")) == ("fork", "spawn")


@pytest.mark.slow  # a server start of its own (~30-60 s on 2 cores)
@pytest.mark.vllm
def test_a_server_asked_to_fork_its_engine_core_starts_and_serves(tmp_path, tiny_qwen2_dir):
    """server.engine_start_method=fork on the CPU engine: the server starts and answers /generate (vLLM's CPU platform
    spawns its engine core whatever the variable says; on a GPU the fork saves the engine core's import of vLLM)."""
    from grpo.inference.process import VLLMServer

    server = VLLMServer(tiny_qwen2_dir, server_cfg(engine_start_method="fork", enforce_eager=True), tmp_path / "v.log")
    server.start()
    try:
        client = server.client()
        (completions,) = client.generate([[1, 2, 3]], n=2, max_tokens=4, temperature=1.0)
        assert len(completions) == 2 and all(len(c.token_ids) >= 1 for c in completions)
        client.close()
    finally:
        server.stop()

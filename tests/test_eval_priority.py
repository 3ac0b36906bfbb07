"""The held-out evaluation yields the engine to training: its requests carry a lower vLLM scheduling priority
(eval.priority) to a server that schedules by priority (server.scheduling_policy), and may be bounded in flight
(eval.max_in_flight); neither changes what it samples."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from omegaconf import OmegaConf

from conftest import server_cfg
from grpo.pipeline.generation import GenerationHandle


def test_request_priority_is_taken_out_of_the_body_and_refused_where_vllm_would_ignore_it():
    from grpo.inference.request_checks import BadRequest, ModelLimits, request_priority

    by_priority, fcfs = ModelLimits(100, 64, scheduling_policy="priority"), ModelLimits(100, 64)
    body = {"priority": 3, "n": 2}
    assert request_priority(body, by_priority) == 3 and body == {"n": 2}  # SamplingParams never sees it
    assert request_priority({}, fcfs) == 0 and request_priority({"priority": 0}, fcfs) == 0
    with pytest.raises(BadRequest, match="--scheduling-policy priority"):
        request_priority({"priority": 1}, fcfs)
    for bad in (1.5, "1", True, None):
        with pytest.raises(BadRequest, match="priority must be an integer"):
            request_priority({"priority": bad}, by_priority)


def test_the_policy_is_read_where_each_vllm_keeps_it():
    """vLLM 0.32's engine client has `scheduler_config`; 0.26's keeps it only in `vllm_config` (on the GPU a priority
    server was read as fcfs and refused every evaluation request). The engine clients' shapes, as the two releases
    build them."""
    import asyncio
    from types import SimpleNamespace

    from grpo.inference.request_checks import model_limits

    model = SimpleNamespace(get_vocab_size=lambda: 100, max_model_len=64)
    scheduler = SimpleNamespace(policy="priority", max_num_seqs=8)
    v032 = SimpleNamespace(model_config=model, scheduler_config=scheduler)
    v026 = SimpleNamespace(model_config=model, vllm_config=SimpleNamespace(scheduler_config=scheduler))
    for engine in (v032, v026):
        limits = asyncio.run(model_limits(engine))
        assert limits.scheduling_policy == "priority" and limits.max_num_seqs == 8


def test_the_launched_server_schedules_by_priority_unless_told_otherwise(tmp_path):
    """server.scheduling_policy reaches vLLM as --scheduling-policy (priority by default); a run whose eval sends a
    priority to a launched server that schedules first come, first served is refused at start-up, naming both keys."""
    from grpo.config_values import ConfigError
    from grpo.inference.process import VLLMServer
    from grpo.pipeline.eval_settings import check_eval_priority
    from test_config import _compose

    cfg = _compose(["server=cpu"])
    args = VLLMServer("model-dir", cfg.server, Path("vllm.log")).command()
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    fcfs = VLLMServer("m", server_cfg(scheduling_policy="fcfs"), Path("v.log")).command()
    assert fcfs[fcfs.index("--scheduling-policy") + 1] == "fcfs"
    assert "--scheduling-policy" not in VLLMServer("m", server_cfg(scheduling_policy=None), Path("v.log")).command()

    def check(**keys) -> None:
        changed = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k.replace('__', '.')}={v}" for k, v in keys.items()]))
        check_eval_priority(changed)

    check()
    with pytest.raises(ConfigError, match=r"eval.priority=1 needs .*server.scheduling_policy=priority.*eval.priority=0"):
        check(server__scheduling_policy="fcfs")
    with pytest.raises(ConfigError, match="schedules 'fcfs'"):
        check(server__extra_args="[--scheduling-policy,fcfs]")
    check(server__scheduling_policy="fcfs", eval__priority=0)
    check(server__scheduling_policy="fcfs", eval__enabled=False)
    check(server__scheduling_policy="fcfs", server__external_url="http://127.0.0.1:1")


def _in_engine(url: str) -> float:
    """vLLM's gauges of the requests running and waiting for a slot in the engine (its Prometheus /metrics)."""
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M))


def _evals_after_the_rollouts(url: str, slots: int, eval_priority: int) -> int:
    """How many eval requests finished after the rollouts: eval requests of 8 sequences of 32 tokens each, three times
    the engine's `slots` sequences in all, at priority `eval_priority`, then, once every one of them is in the engine
    (running or waiting for a slot), one rollout request of 32 such sequences at priority 0."""
    same_length = {"max_tokens": 32, "ignore_eos": True, "temperature": 1.0, "logprobs": None, "n": 8}
    evals = [{"prompt": [11 + i % 50, 12, 13], **same_length, "priority": eval_priority} for i in range(3 * slots // 8)]
    rollouts = {"prompts": [[70 + i, 71, 72] for i in range(4)], **same_length}
    done: list[tuple[float, str]] = []

    def post(name: str, body: dict) -> None:
        r = requests.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        done.append((time.monotonic(), name))

    with ThreadPoolExecutor(len(evals) + 1) as pool:
        futures = [pool.submit(post, "eval", body) for body in evals]
        deadline = time.monotonic() + 60
        while _in_engine(url) < 3 * slots:
            assert time.monotonic() < deadline and not any(f.done() for f in futures), "the evals never filled it"
            time.sleep(0.02)
        futures.append(pool.submit(post, "rollouts", rollouts))
        for future in futures:
            future.result()
    order = [name for _, name in sorted(done)]
    return len(order) - 1 - order.index("rollouts")


@pytest.mark.slow  # it fills the engine on a clock: flaky on a loaded 2-core CI host
@pytest.mark.vllm
def test_rollouts_sent_after_a_batch_of_eval_requests_finish_first(vllm_server):
    """On the real server (the session's, started with the default server.scheduling_policy=priority): a rollout
    request sent while eval requests at priority 1 fill the engine's slots three times over is admitted ahead of the
    waiting eval sequences and finishes while a whole round of them is still to run; at the eval's priority 0 (what
    every request had before) it waits behind all of them and finishes last."""
    version = requests.get(vllm_server.url + "/grpo/version", timeout=30).json()
    assert version["scheduling_policy"] == "priority"
    slots = version["max_num_seqs"]
    behind = _evals_after_the_rollouts(vllm_server.url, slots, eval_priority=1)
    ahead = _evals_after_the_rollouts(vllm_server.url, slots, eval_priority=0)
    print(f"\n{slots} slots: eval requests finished after the rollouts: {behind} of {3 * slots // 8} at priority 1, "
          f"{ahead} at priority 0")
    assert behind >= slots // 8  # the eval's third round (the rollouts ran in its second)
    assert ahead <= 1  # the rollouts ran in a fourth round of their own


class _CountingClient:
    """Wraps a real InferenceClient's POST to count the sequences (prompts x n) of /generate requests out at once."""

    def __init__(self, client) -> None:
        self.client, self.lock, self.now, self.most = client, threading.Lock(), 0, 0
        self.post = client._post
        client._post = self._post

    def _post(self, path: str, payload: dict, timeout: float | None = None):
        count = len(payload.get("prompts", [None])) * payload.get("n", 1)
        with self.lock:
            self.now += count
            self.most = max(self.most, self.now)
        try:
            return self.post(path, payload, timeout)
        finally:
            with self.lock:
                self.now -= count


@pytest.mark.vllm
def test_max_in_flight_bounds_the_sequences_out_at_once_and_changes_no_sample(vllm_server):
    """`max_in_flight` splits a call into requests of at most that many sequences and sends only as many at once as
    fit it (at least one prompt's n): the same seeded completions as the call without a bound."""
    from grpo.inference.client import InferenceClient

    prompts = [[10 + i, 20, 30] for i in range(10)]
    kw = dict(n=3, max_tokens=6, temperature=1.0, seed=5, logprobs=False)
    free = _CountingClient(InferenceClient(vllm_server.url, max_concurrency=16))
    bounded = _CountingClient(InferenceClient(vllm_server.url, max_concurrency=16))
    tight = _CountingClient(InferenceClient(vllm_server.url, max_concurrency=16))
    unbounded = free.client.generate(prompts, **kw)
    assert free.most == 30
    tokens = [[c.token_ids for c in group] for group in unbounded]
    assert [[c.token_ids for c in group] for group in bounded.client.generate(prompts, max_in_flight=7, **kw)] == tokens
    assert bounded.most <= 7
    assert [[c.token_ids for c in group] for group in tight.client.generate(prompts, max_in_flight=1, **kw)] == tokens
    assert tight.most == 3  # one prompt's n


@pytest.mark.vllm
def test_the_evaluation_behind_the_rollouts_gives_the_same_figures(vllm_server, tiny_qwen2_dir, tmp_path):
    """The same weights evaluated with eval.priority=0 and no bound (the requests as they were sent before), and with
    eval.priority=1 and eval.max_in_flight=4: the same accuracies, pass@k and completions."""
    import json

    from transformers import AutoTokenizer

    from grpo.inference.client import Endpoint
    from grpo.pipeline.evaluation import EvalContext, Evaluator
    from grpo.tasks.prompts import DigitsTask
    from grpo.tasks.rewards import DigitFractionReward

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    figures, samples = [], []
    for i, settings in enumerate(({"priority": 0}, {"priority": 1, "max_in_flight": 4})):
        run_dir = tmp_path / str(i)
        run_dir.mkdir()
        ctx = EvalContext(tokenizer=tok,
                          generation=GenerationHandle(lambda: Endpoint(vllm_server.url, None, 0)),
                          run_dir=run_dir, seed=0,
                          total_steps=4, max_seq_len=512)
        ev = Evaluator(task=DigitsTask(eval_size=8), rewards={"digits": DigitFractionReward()}, k=2,
                       samples_per_prompt=3, max_new_tokens=8, correct_threshold=0.5, samples_logged=8, **settings)
        ev.setup(ctx)
        metrics = ev.evaluate(0)
        ev.close()
        figures.append({k: v for k, v in metrics.items() if k not in ("eval/seconds", "eval/generation_seconds")})
        samples.append([json.loads(x) for x in (run_dir / "eval_samples.jsonl").read_text().splitlines()])
    assert figures[0] == figures[1] and samples[0] == samples[1]
    assert figures[0]["eval/prompts"] == 8 and "eval/pass@k" in figures[0]

"""grpo.pipeline.generation.GenerationHandle: the one way pipelines and the evaluator reach the server."""

from __future__ import annotations

import threading
import time

import pytest

from grpo.inference.client import Completion, Endpoint
from grpo.pipeline.generation import GenerationHandle, check_completions
from grpo.serving.gate import GenerationGate


def _completion(logprobs=(-0.5, -0.25), version=3, last=3) -> Completion:
    return Completion(token_ids=[5, 6], logprobs=None if logprobs is None else list(logprobs), finish_reason="length",
                      weight_version=version, last_weight_version=last)


@pytest.mark.parametrize("outs, n, logprobs, message", [
    ([[_completion()]], 2, True, "returned 1 completions, asked for 2"),
    ([[_completion(logprobs=None)]], 1, True, "no log-probs though asked"),
    ([[_completion()]], 1, False, "log-probs though not asked"),
    ([[_completion(logprobs=(-0.5,))]], 1, True, "1 log-probs for 2 tokens"),
    ([[_completion(version=-1, last=-1)]], 1, True, "weight versions -1 .. -1"),
    ([[_completion(version=4, last=3)]], 1, True, "weight versions 4 .. 3"),
])
def test_an_answer_that_is_not_what_was_asked_is_refused_naming_the_server(outs, n, logprobs, message):
    with pytest.raises(RuntimeError, match="inference server at http://srv") as error:
        check_completions(outs, n, logprobs, "http://srv")
    assert message in str(error.value)
    check_completions([[_completion(), _completion(version=3, last=5)]], 2, True, "http://srv")  # what was asked


def test_each_thread_gets_its_own_client_a_new_one_when_the_replicas_move_and_close_closes_them_all():
    urls = ["http://a:1"]
    handle = GenerationHandle(lambda: Endpoint(urls[0], None, 0), max_concurrency=3)
    first = handle.client()
    assert handle.client() is first and first.urls == ("http://a:1",)
    assert first.clients["http://a:1"].max_concurrency == 3
    other: list = []
    thread = threading.Thread(target=lambda: other.append(handle.client()))
    thread.start()
    thread.join()
    assert other[0] is not first
    urls[0] = "http://b:2"  # a restart moved the server
    moved = handle.client()
    assert moved is not first and moved.urls == ("http://b:2",)
    own = handle.with_clients(gated=False, max_concurrency=5)
    assert own.gate is None and own.client() is not moved and own.client().clients["http://b:2"].max_concurrency == 5
    handle.close()
    assert handle.client() is not moved  # closed: a later call builds a new one


@pytest.mark.vllm
def test_generation_waits_at_a_held_gate_and_reads_the_endpoint_only_once_it_reopens(vllm_server):
    """A restarting sync holds the gate: a call made meanwhile must not read the endpoint (the server it names is going
    away) until the gate reopens, then samples from the endpoint read then, with its model name."""
    gate = GenerationGate()
    reads: list[float] = []

    def endpoint() -> Endpoint:
        reads.append(time.monotonic())
        return Endpoint(vllm_server.url, None, 0)

    handle = GenerationHandle(endpoint, gate)
    outs: list = []
    try:
        with gate.held():
            thread = threading.Thread(target=lambda: outs.append(
                handle.generate([[1, 2, 3], [4, 5]], n=2, max_tokens=3, temperature=1.0, logprobs=True, seed=1)))
            thread.start()
            time.sleep(0.3)
            assert reads == [] and not outs
            reopened = time.monotonic()
        thread.join(60)
        assert len(reads) == 1 and reads[0] >= reopened
        assert [len(per_prompt) for per_prompt in outs[0]] == [2, 2]
        assert all(c.logprobs is not None and c.weight_version >= 0 for per in outs[0] for c in per)
    finally:
        handle.close()

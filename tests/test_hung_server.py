"""A vLLM server that hangs (SIGSTOP, a deadlock) while generation requests are out: it accepts them and never
answers. Before, each request waited for the client's 600 s timeout and its 3 retries (40 minutes) before the
trainer's restart path saw an error, and Ctrl-C / SIGTERM waited with them (a run stopped by `timeout 150` was still
there 10 minutes later). Now the client asks /health while its requests are out and gives up on a server that does
not answer it; so does a sync's weight update (an in-place reload, an adapter swap)."""

from __future__ import annotations

import json
import re
import socket

import pytest

from conftest import free_port
from grpo.inference.client import InferenceClient, ServerUnreachable
from test_reliability import server_starts, train
from test_train_e2e import assert_clean


@pytest.fixture()
def hung_server():
    """What a stopped server is to a client: a listening socket whose connections the kernel completes and nobody
    ever answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _per_prompt(client: InferenceClient) -> InferenceClient:
    client.prompts_per_request = 0  # one request per prompt (Atropos' form)
    return client


@pytest.mark.parametrize("call, what", [
    (lambda c: c.generate([[1, 2], [3, 4], [5, 6]], n=2, max_tokens=4),
     "1 of 1 generation requests (3 prompts, up to 64 per request)"),
    (lambda c: _per_prompt(c).generate([[1, 2], [3, 4], [5, 6]], n=2, max_tokens=4), "3 of 3 generation requests"),
    (lambda c: c.reload_weights("/weights/v2", version=2), "1 of 1 requests (/grpo/reload_weights)"),  # mode=none
    (lambda c: c.load_lora("policy-v2", "/adapters/v2"), "1 of 1 requests (/v1/load_lora_adapter)"),  # lora_only
], ids=["generate", "generate_per_prompt", "reload_weights", "load_lora"])
def test_a_call_on_a_server_that_stops_answering_fails_on_its_health_not_the_request_timeout(hung_server, call, what):
    """Generation, and a sync's weight update (GRPO_FAULT=stop_server_syncing: the same wait, then the loop's
    restart and second sync)."""
    client = InferenceClient(hung_server, timeout=30, retries=3)  # the requests alone: 4 x 30 s before an error
    client.health_every_s = client.health_timeout_s = 0.5
    try:
        with pytest.raises(ServerUnreachable, match=re.escape(f"stopped answering /health (within 0.5 s) while {what} "
                                                              "were out: hung or dead")):
            call(client)
    finally:
        client.close()


@pytest.mark.slow  # ~100 s: one vLLM start, the hang noticed (~20 s), the health check's 10 s and a restart
@pytest.mark.vllm
def test_vllm_stopped_while_generating_is_restarted_and_the_run_completes(tmp_path):
    run = tmp_path / "run"
    code, out, marker = train("train.steps=3", "server.max_restarts=1", f"server.port={free_port()}",
                              f"hydra.run.dir={run}", fault="stop_server_generating@2", timeout=300)
    assert code == 0, out[-3000:]
    assert "not answering /health within 10s; restart 1 of 1 on weight version 1" in out, out[-3000:]
    table = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [1, 2, 3] and [r["server/restarts"] for r in table] == [0, 1, 1]
    assert server_starts(run)[1] == str(run / "served_weights" / "v1")
    assert_clean(marker)

"""InferenceClient.generate's batched /generate requests against a stand-in server (no vLLM): what it sends, how it
splits a large call and its seeds, and its fall-back to one request per prompt on a server without the batched form."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo.inference.client import InferenceClient, InferenceServerError


def _answer(prompt: list[int], body: dict) -> dict:
    """A /generate answer that echoes what was asked: sample k's tokens are [seed + k, first prompt token]."""
    seed = body.get("seed", -1)
    ids = [[seed + k, prompt[0]] for k in range(body.get("n", 1))]
    return {"text": [""] * len(ids), "prompt_token_ids": prompt, "token_ids": ids, "logprobs": [None] * len(ids),
            "finish_reasons": ["stop"] * len(ids), "weight_version": 3, "last_weight_version": 4}


class _Server(ThreadingHTTPServer):
    batched = True  # False: answers a batched body as a grpo server before the batched form did
    bodies: list


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        status, answer = 200, None
        if self.path != "/generate":
            status, answer = 404, {"detail": "Not Found"}
        elif "prompts" in body and self.server.batched:
            seed = body.get("seed")
            answer = {"results": [_answer(p, {**body, "seed": -1 if seed is None else seed + i * body["n"]})
                                  for i, p in enumerate(body["prompts"])], "weight_version": 3, "last_weight_version": 4}
        elif "prompt" in body:
            answer = _answer(body["prompt"]["prompt_token_ids"], body)
        else:
            status, answer = 400, {"error": "ValueError: body must be a JSON object with a 'prompt'"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.bodies = []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _seeds(groups) -> list[list[int]]:
    return [[c.token_ids[0] for c in group] for group in groups]


def test_batched_requests_carry_the_per_prompt_seeds(server):
    prompts = [[10 + i] for i in range(5)]
    client = InferenceClient(f"http://127.0.0.1:{server.server_address[1]}", prompts_per_request=2)
    groups = client.generate(prompts, n=3, max_tokens=4, seed=100, logprobs=False)
    assert _seeds(groups) == [[100 + i * 3 + k for k in range(3)] for i in range(5)]
    assert [c.token_ids[1] for group in groups for c in group] == [10 + i for i in range(5) for _ in range(3)]
    assert sorted(len(b["prompts"]) for b in server.bodies) == [1, 2, 2]  # split, sent concurrently
    assert sorted(b["seed"] for b in server.bodies) == [100, 106, 112]  # each request's first prompt's seed
    assert all(b["logprobs"] is None and b["n"] == 3 and "prompt" not in b for b in server.bodies)
    assert {(c.weight_version, c.last_weight_version) for group in groups for c in group} == {(3, 4)}
    client.close()


def test_a_server_without_the_batched_form_gets_one_request_per_prompt(server):
    server.batched = False
    client = InferenceClient(f"http://127.0.0.1:{server.server_address[1]}")
    groups = client.generate([[7], [8], [9]], n=2, max_tokens=4, seed=10, logprobs=False)
    assert _seeds(groups) == [[10, 11], [12, 13], [14, 15]]  # the same seeds as the batched form
    assert client.prompts_per_request == 0  # asked once, remembered
    assert len(server.bodies) == 1 + 3
    assert all(b["logprobs"] is None and b["n"] == 2 for b in server.bodies[1:])  # asked as the batched form asked
    client.generate([[7]], n=2, max_tokens=4)
    assert len(server.bodies) == 1 + 3 + 1 and "prompt" in server.bodies[-1]
    client.close()


def test_other_errors_of_a_batched_request_are_raised(server):
    client = InferenceClient(f"http://127.0.0.1:{server.server_address[1]}/nope", retries=0)
    with pytest.raises(InferenceServerError, match="HTTP 404"):
        client.generate([[1]], max_tokens=1)
    assert client.prompts_per_request == 64 and len(server.bodies) == 1  # no fall-back on another error
    client.close()


@pytest.mark.parametrize("error, status, message", [
    (ValueError("bad n"), 400, "prompts[2]: ValueError: bad n"),
    (LookupError("unknown model"), 404, "prompts[2]: LookupError: unknown model"),
    (RuntimeError("engine died"), 500, "prompts[2]: RuntimeError: engine died"),
])
def test_a_failed_prompt_of_a_batch_is_answered_with_its_causes_status_and_index(error, status, message):
    from grpo.inference.generate import PromptFailed
    from grpo.inference.server import error_answer

    assert error_answer(PromptFailed(2, error)) == ({"error": message}, status)

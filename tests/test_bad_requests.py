"""Bad requests to /generate are 4xx with the reason, not 500 (issue 21.5), on the real vLLM engine; and the
prompt top-k log-probs have the shape atroposlib's get_logprobs(top_k=k) expects (issue 21.7)."""

from __future__ import annotations

import asyncio

import pytest
import requests

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 512  # conftest.server_cfg


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"prompt": {"prompt_token_ids": [1, 10_000_000]}, "max_tokens": 2}, "out of vocabulary"),
        ({"prompt": [1, -3], "max_tokens": 2}, "out of vocabulary"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"prompt": [1, 2], "max_tokens": -5}, "max_tokens must be >= 1"),
        ({"prompt": [1] * (MAX_MODEL_LEN + 88), "max_tokens": 2}, "max_model_len is 512"),
        ({"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}, "leaves no room to generate"),
        ({"prompt": [], "max_tokens": 2}, "empty prompt"),
        ({"prompt": "", "max_tokens": 2}, "empty prompt"),
        ({"prompt": {"prompt_token_ids": []}, "max_tokens": 2}, "empty prompt"),
        # Issue 44.5: coerced and served ([1, 2], [7, 8], [1, 0]), or a Python TypeError's text for null.
        ({"prompt": {"prompt_token_ids": [1.7, 2.2]}, "max_tokens": 2}, "must hold integer token ids only"),
        ({"prompt": {"prompt_token_ids": ["7", "8"]}, "max_tokens": 2}, "must hold integer token ids only"),
        ({"prompt": {"prompt_token_ids": [True, False]}, "max_tokens": 2}, "must hold integer token ids only"),
        ({"prompt": {"prompt_token_ids": None}, "max_tokens": 2}, "prompt_token_ids must be a list of integer"),
        ({"prompts": [[1, 2], {"prompt_token_ids": [1.5]}], "max_tokens": 2}, "prompts[1]: prompt_token_ids must"),
        # Issue 44.4: n=10000 held the engine 46 s; max_tokens=10**9 was cut at the context without a word.
        ({"prompt": [1, 2], "max_tokens": 2, "n": 10_000}, "(vLLM's --max-num-seqs); send several requests"),
        ({"prompts": [[1, 2]], "max_tokens": 2, "n": 10_000}, "n=10000 is more samples than the server runs"),
        ({"prompt": [1, 2], "max_tokens": 2, "n": 0}, "n must be an integer >= 1"),
        ({"prompt": [1, 2], "max_tokens": 10**9}, f"at most {MAX_MODEL_LEN - 2} (the server's max_model_len"),
    ],
    ids=["oov", "negative_id", "max_tokens_0", "max_tokens_negative", "too_long", "no_room", "empty_list",
         "empty_text", "empty_ids", "float_ids", "string_ids", "bool_ids", "null_ids", "batch_float_id",
         "n_too_many", "batch_n_too_many", "n_0", "max_tokens_past_context"],
)
def test_bad_generate_request_is_400_with_the_reason(vllm_server, body, reason):
    r = requests.post(vllm_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]


def test_server_keeps_serving_after_bad_requests(vllm_server):
    url = vllm_server.url + "/generate"
    for body in ({"prompt": [10_000_000], "max_tokens": 1}, {"prompt": [], "max_tokens": 1}):
        assert requests.post(url, json=body, timeout=60).status_code == 400
    ok = requests.post(url, json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["token_ids"][0]) == 3
    assert vllm_server.healthy()


def test_atroposlib_client_does_not_retry_a_bad_request(vllm_server, tiny_qwen2_dir):
    """atroposlib retries 5xx as server faults; a 4xx reaches the environment at once as an HTTP error."""
    import aiohttp
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer as AtroposVLLM

    cfg = APIServerConfig(api_key="x", base_url=vllm_server.url + "/v1", model_name=str(tiny_qwen2_dir), timeout=60,
                          health_check=False)
    atropos = AtroposVLLM(cfg)
    with pytest.raises(aiohttp.ClientResponseError) as e:
        asyncio.run(atropos._tokens_and_logprobs_completion_wrapper(
            input_ids=[1, 10_000_000], n=1, max_tokens=2, model=str(tiny_qwen2_dir)))
    assert e.value.status == 400


@pytest.mark.parametrize("k", [1, 3])
def test_prompt_topk_shape_matches_atroposlib(vllm_server, tiny_qwen2_dir, k):
    """get_logprobs(top_k=k): one row per prompt token, exactly k entries per position after the first (the actual
    token first, then the most likely others), and the first position carries the given token."""
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer as AtroposVLLM

    cfg = APIServerConfig(api_key="x", base_url=vllm_server.url + "/v1", model_name=str(tiny_qwen2_dir), timeout=60,
                          health_check=False)
    out = asyncio.run(AtroposVLLM(cfg).get_logprobs(input_ids=[5, 17, 99, 3, 42, 7], top_k=k))
    ids, topk_ids, topk_lps = out["prompt_tokens"], out["prompt_topk_token_ids"], out["prompt_topk_logprobs"]
    assert len(topk_ids) == len(topk_lps) == len(ids) == 6
    assert topk_ids[0] == [ids[0]] and topk_lps[0] == [0.0]
    for pos in range(1, len(ids)):
        assert len(topk_ids[pos]) == len(topk_lps[pos]) == k
        assert topk_ids[pos][0] == ids[pos]
        assert len(set(topk_ids[pos])) == k and all(lp <= 0.0 for lp in topk_lps[pos])
    # The actual token's log-prob agrees with vLLM's own /v1/completions prompt_logprobs.
    ref = vllm_server.client().prompt_logprobs(ids)
    assert max(abs(a - b) for a, b in zip([row[0] for row in topk_lps[1:]], ref)) < 1e-5

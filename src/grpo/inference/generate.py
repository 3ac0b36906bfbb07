"""POST /generate of the inference server: Atropos' request and answer shape, one prompt or several at once
(`handle_generate_batch`), with the weight versions the answer was sampled on (grpo.inference.served_version)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from grpo.inference.request_checks import (
    BadRequest,
    ModelLimits,
    check_generate_request,
    check_prompt_chars,
    check_samples,
    check_sequences,
    model_limits,
    request_priority,
    token_ids,
)
from grpo.inference.served_version import app_state, request_versions

# Scope key of the engine request ids a /generate call started (aborted when its client disconnects).
REQUEST_IDS = "grpo.request_ids"


async def _lora_request(state, name: str | None):
    """The LoRARequest registered under `name` (None for the base model or no name)."""
    if not name:
        return None
    models = state.openai_serving_models
    if name in {p.name for p in models.base_model_paths}:
        return None
    lora = models.lora_requests.get(name)
    if lora is None:
        known = [p.name for p in models.base_model_paths] + sorted(models.lora_requests)
        raise LookupError(f"unknown model {name!r}; served: {known}")
    return lora


def _position_logprobs(entry: Any, token_id: int) -> dict[int, float]:
    """{token_id: logprob} of one position with the actual token first (Atropos reads the first key)."""
    out = {token_id: float(entry[token_id].logprob)}
    for tid, lp in entry.items():
        if tid != token_id:
            out[tid] = float(lp.logprob)
    return out


def _sample_logprobs(token_ids: Any, logprobs: Any) -> list[list[dict[int, float]]]:
    """One [{token_id: logprob}] per generated position, the actual token first, from vLLM's per-position dicts or
    from its flat layout (``flat_logprobs``: parallel lists, read directly instead of a dict built per position)."""
    if not logprobs:
        return []
    if not hasattr(logprobs, "start_indices"):
        return [[_position_logprobs(entry, tid)] for tid, entry in zip(token_ids, logprobs)]
    ids, values = logprobs.token_ids, logprobs.logprobs
    out = []
    for tid, start, end in zip(token_ids, logprobs.start_indices, logprobs.end_indices):
        pos = {ids[i]: float(values[i]) for i in range(start, end)}
        out.append([{tid: pos.pop(tid), **pos}])
    return out


async def _prompt_ids(prompt: Any, engine: Any, limits: ModelLimits) -> list[int]:
    """The token ids of one /generate prompt: a string (tokenized here), a list of ids or {"prompt_token_ids": [...]}.
    A string is refused by its length first, then tokenized on a thread: on the event loop, a long one kept every
    other request, /health included, waiting until it was done."""
    if isinstance(prompt, str):
        check_prompt_chars(prompt, limits)
        return list(await asyncio.to_thread(engine.get_tokenizer().encode, prompt))
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return token_ids(prompt["prompt_token_ids"])
    if isinstance(prompt, list):
        return token_ids(prompt, "a prompt given as a list")
    raise ValueError("'prompt' must be a string, a list of token ids or {'prompt_token_ids': [...]}")


def _sampling_params(body: dict[str, Any]) -> Any:
    """vLLM SamplingParams of a /generate body (its sampling keys, the prompt and model already taken out)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # Atropos' clients read log-probs without always asking for them: absent means 0 (the sampled token's). An
    # explicit null asks for none, as in vLLM (the trainer's on-policy rollouts and evaluations need none: vLLM then
    # skips their work on every decode step); each sample's "logprobs" is then null and "token_ids" carries it.
    if "logprobs" not in body:
        body["logprobs"] = 0
    # vLLM's flat layout keeps a request's log-probs in a few lists instead of a dict and a Logprob object per token
    # per step: less work in the API process on every decode step (the response is the same).
    body.setdefault("flat_logprobs", True)
    body["output_kind"] = RequestOutputKind.FINAL_ONLY
    if decodes_here(body):
        body["detokenize"] = False
    _typed_sampling_keys(body)
    return SamplingParams(**body)


def decodes_here(body: dict[str, Any]) -> bool:
    """True when a /generate answer's text is decoded here, once per sample at the end and on a thread
    (`_prompt_response`), not by vLLM: it decodes the text at every step on its event loop, and every log-prob
    candidate as well (logprobs=20: 21 decodes per sample per step; n=128 long samples with them kept /health
    waiting for tens of seconds). Not with stop strings, which need vLLM's incremental text, nor when the request
    sets `detokenize` itself."""
    return "detokenize" not in body and not body.get("stop")


def _typed_sampling_keys(body: dict[str, Any]) -> None:
    """`logit_bias` and `structured_outputs` of a /generate body in the types SamplingParams holds, as
    /v1/completions builds them: given as JSON ({"<token id>": bias}, {"choice": [...]}) they reached the engine as
    they were and failed there (HTTP 500, an empty EngineGenerateError)."""
    from vllm.sampling_params import StructuredOutputsParams

    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest(f"logit_bias must be an object {{token id: bias}}, got {bias!r:.80}")
        try:
            # vLLM's own rule (SamplingParams.from_optional): integer ids, biases clamped to [-100, 100].
            body["logit_bias"] = {int(t): min(100.0, max(-100.0, float(b))) for t, b in bias.items()}
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias must map integer token ids to numbers, got {bias!r:.80}") from None
    constraint = body.get("structured_outputs")
    if constraint is not None:
        if not isinstance(constraint, dict):
            raise BadRequest("structured_outputs must be an object such as {\"choice\": [...]}, {\"regex\": ...} or "
                             f"{{\"json\": <schema>}}, got {constraint!r:.80}")
        try:
            body["structured_outputs"] = StructuredOutputsParams(**constraint)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"structured_outputs: {e}") from None


def _engine_input(prompt_ids: list[int]) -> dict[str, Any]:
    """The engine's input for token ids: vLLM's rendered form where it has one (>= 0.30: `AsyncLLM.add_request` takes
    it as is, in the event loop; a raw {"prompt_token_ids"} dict is rendered on its renderer's thread pool first, one
    thread hop per request), else the raw form."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:
        return {"prompt_token_ids": prompt_ids}
    return dict(tokens_input(prompt_ids))


async def _final_output(engine: Any, prompt_ids: list[int], params: Any, lora: Any, ids: list[str],
                        priority: int = 0) -> Any:
    """The finished RequestOutput of one prompt (all its `n` samples); its engine request id is added to `ids`."""
    final = None
    request_id = f"grpo-gen-{uuid.uuid4().hex}"
    ids.append(request_id)
    async for out in engine.generate(_engine_input(prompt_ids), params, request_id, lora_request=lora,
                                     priority=priority):
        final = out
    assert final is not None
    return final


def _prompt_response(prompt_ids: list[int], final: Any, params: Any, version: int, last_version: int,
                     tokenizer: Any = None) -> dict:
    """The /generate answer for one prompt (the shape Atropos' VLLMServer reads, plus the weight versions); the text
    decoded with `tokenizer` when given (`decodes_here`), else vLLM's."""
    outputs = final.outputs
    if tokenizer is not None:
        texts = tokenizer.batch_decode([list(o.token_ids) for o in outputs],
                                       skip_special_tokens=params.skip_special_tokens)
    else:
        texts = [o.text for o in outputs]
    resp: dict[str, Any] = {
        "text": texts,
        "prompt_token_ids": prompt_ids,
        "token_ids": [list(o.token_ids) for o in outputs],
        "logprobs": [_sample_logprobs(o.token_ids, o.logprobs) if params.logprobs is not None else None
                     for o in outputs],
        "finish_reasons": [o.finish_reason for o in outputs],
        "weight_version": version,
        "last_weight_version": last_version,
    }
    if params.prompt_logprobs is not None:
        resp["prompt_logprobs"] = prompt_topk(prompt_ids, final.prompt_logprobs or [], params.prompt_logprobs)
    return resp


async def handle_generate(request) -> dict:
    """POST /generate: {"prompt": {"prompt_token_ids": [...]} | str | [int], "n", "max_tokens", ...} (Atropos' shape),
    or several prompts at once: {"prompts": [<prompt>, ...], ...} (`handle_generate_batch`)."""
    state = app_state(request)
    engine = state.engine_client
    body = await request.json()
    ids = request.scope.setdefault(REQUEST_IDS, [])
    if isinstance(body, dict) and "prompts" in body:
        return await handle_generate_batch(state, body, ids)
    if not isinstance(body, dict) or "prompt" not in body:
        raise ValueError("body must be a JSON object with a 'prompt' (or a 'prompts' list)")
    prompt = body.pop("prompt")
    body.pop("stream", None)  # Atropos never streams; answer once.
    lora = await _lora_request(state, body.pop("model", None) or body.pop("lora", None))
    limits = await model_limits(engine)
    check_samples(body.get("n", 1), limits)
    check_sequences(1, body.get("n", 1), limits)
    priority = request_priority(body, limits)
    prompt_ids = await _prompt_ids(prompt, engine, limits)
    check_generate_request(prompt_ids, body.get("max_tokens"), limits, body.get("n", 1))
    tokenizer = engine.get_tokenizer() if decodes_here(body) else None
    params = _sampling_params(body)
    # Read before the request starts: the version the weights had when this batch was scheduled.
    version = request_versions(state, lora)[0]
    final = await _final_output(engine, prompt_ids, params, lora, ids, priority)
    # Built on a thread: n=128 long samples with 20 log-probs each took seconds of the event loop (/health waited).
    return await asyncio.to_thread(_prompt_response, prompt_ids, final, params, version,
                                   request_versions(state, lora)[1], tokenizer)


def describe(e: BaseException) -> str:
    """`Type: message` of an error, never without a reason: vLLM's EngineGenerateError has an empty message and
    carries its reason as its cause."""
    if str(e):
        return f"{type(e).__name__}: {e}"
    inner = e.__cause__ or e.__context__
    reason = describe(inner) if inner is not None else "no reason given; see the server log"
    return f"{type(e).__name__} ({reason})"


class PromptFailed(Exception):
    """Generation of prompt `index` of a batched /generate failed with `cause` (answered with the cause's status)."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"prompts[{index}]: {describe(cause)}")
        self.index = index
        self.cause = cause


async def handle_generate_batch(state: Any, body: dict[str, Any], ids: list[str]) -> dict:
    """POST /generate with {"prompts": [...], <the single form's sampling keys>}: every prompt is checked first (a bad
    one is a 400 naming its index), then all are handed to the engine before any is awaited, so they share engine
    steps, as one request of the single form per prompt sent at once never quite does over HTTP.

    `seed` is the base seed of the batch: prompt i is sampled with `seed + i * n` (sample k of it `seed + i * n + k`,
    vLLM's rule for n > 1), what `InferenceClient.generate` gives prompt i through the single form. Answer:
    {"results": [<the single form's answer for prompt i>, ...], "weight_version", "last_weight_version"} (the versions
    at admission and at finish of the whole batch, also in every result). The engine request ids go to `ids`."""
    engine = state.engine_client
    prompts = body.pop("prompts")
    if "prompt" in body:
        raise BadRequest("give either 'prompt' (one) or 'prompts' (a list), not both")
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest(f"'prompts' must be a non-empty list of prompts, got {type(prompts).__name__} {prompts!r:.80}")
    body.pop("stream", None)
    lora = await _lora_request(state, body.pop("model", None) or body.pop("lora", None))
    limits = await model_limits(engine)
    check_samples(body.get("n", 1), limits)  # once, not as prompts[0]'s fault
    check_sequences(len(prompts), body.get("n", 1), limits)
    priority = request_priority(body, limits)
    prompt_ids = []
    for i, prompt in enumerate(prompts):
        try:
            one = await _prompt_ids(prompt, engine, limits)
            check_generate_request(one, body.get("max_tokens"), limits, body.get("n", 1))
        except ValueError as e:
            raise BadRequest(f"prompts[{i}]: {e}", getattr(e, "status", 400)) from e
        prompt_ids.append(one)
    seed, n = body.pop("seed", None), body.get("n", 1)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    tokenizer = engine.get_tokenizer() if decodes_here(body) else None
    # One SamplingParams per prompt, built as the single form builds it (same checks; the seed as the client sets it).
    per_prompt = [_sampling_params(dict(body) if seed is None else {**body, "seed": (seed + i * int(n)) % (2**63)})
                  for i in range(len(prompt_ids))]
    version = request_versions(state, lora)[0]
    # Tasks, not awaited one by one: each adds its request to the engine at its first step, all before the engine
    # has answered any.
    tasks = [asyncio.ensure_future(_final_output(engine, one, p, lora, ids, priority))
             for one, p in zip(prompt_ids, per_prompt)]
    # Cancelled when the client goes away (GRPOMiddleware): gather cancels each task, and vLLM aborts its request.
    finals = await asyncio.gather(*tasks, return_exceptions=True)
    failed = next(((i, f) for i, f in enumerate(finals) if isinstance(f, BaseException)), None)
    if failed is not None:
        raise PromptFailed(*failed)
    last = request_versions(state, lora)[1]
    # Built on a thread (as in the single form): a large batch's answer kept /health waiting for seconds.
    results = await asyncio.to_thread(
        lambda: [_prompt_response(one, f, p, version, last, tokenizer)
                 for one, f, p in zip(prompt_ids, finals, per_prompt)])
    return {"results": results, "weight_version": version, "last_weight_version": last}


def prompt_topk(prompt_ids: list[int], entries: list[Any], k: int) -> list[dict[int, float]]:
    """One {token_id: logprob} per prompt position, the shape atroposlib's `get_logprobs(top_k=k)` reads
    (`prompt_topk_*[pos][k]`, one row per prompt token, as its own tests build it).

    vLLM gives position 0 no distribution (nothing precedes it) and at every later position the top k plus the
    actual token when it is not among them (k + 1 entries). Here position 0 carries the given token with log-prob
    0.0 (it is given, not sampled), and every later position exactly max(k, 1) entries: the actual token first (the
    key Atropos reads, as for generated tokens), then the most likely others by rank.
    """
    k = max(int(k), 1)
    out: list[dict[int, float]] = []
    for pos, tid in enumerate(prompt_ids):
        entry = entries[pos] if pos < len(entries) else None
        if not entry:  # None, or an empty position in vLLM's flat layout
            out.append({tid: 0.0})
            continue
        row = {tid: float(entry[tid].logprob)}
        for other, lp in sorted(entry.items(), key=lambda item: item[1].rank or 0):
            if len(row) >= k:
                break
            row.setdefault(other, float(lp.logprob))
        out.append(row)
    return out


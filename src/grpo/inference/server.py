"""vLLM's own OpenAI-compatible server plus the endpoints a GRPO trainer needs.

    python -m grpo.inference.server <vLLM api_server args>      (console script: grpo-serve)

This is not a fork: `main()` runs vLLM's api_server entry point unchanged and adds, through vLLM's supported
`--middleware` option, one pure-ASGI middleware (`GRPOMiddleware`) that answers a handful of extra paths and passes
every other request to vLLM untouched:

- ``POST /generate``: Atropos-compatible generation (the request/response shape
  `atroposlib/envs/server_handling/vllm_server.py` sends and reads), plus ``weight_version`` (the version served
  when the request was admitted: at most that of any of its tokens) and ``last_weight_version`` (when it finished:
  at least that of any token; an in-place reload counts from the moment it starts). They differ when a sync landed
  while the request ran. Several prompts in one request, ``{"prompts": [...], ...}`` (`handle_generate_batch`, what
  `InferenceClient.generate` sends), are handed to the engine at once and answered ``{"results": [...]}``, one
  single-prompt answer per prompt. ``priority`` (an integer, default 0) is vLLM's per-request scheduling priority
  (lower first; a server started with ``--scheduling-policy priority``, which the trainer's launcher passes by
  default): the held-out evaluation sends a larger one than the rollouts, so its requests yield to training's.
- ``GET|POST /grpo/weight_version``: the weight version served (rollouts carry it).
- ``POST /grpo/reload_weights``: reload full HF weights from a directory in place (vLLM's worker
  `reload_weights`, wrapped by our worker extension, through `collective_rpc`), reset the prefix cache, bump the version.
- ``POST /grpo/pause`` / ``POST /grpo/resume``: vLLM's pause / `resume_generation` ("keep": requests in flight
  freeze and go on after resume).
- ``POST /grpo/rpc``: call a `grpo_*` method of the worker extension (`WeightSyncExtension`) on every worker.
- ``POST /grpo/weight_transfer/init`` and ``/update``: vLLM's NCCL weight-transfer engine (mode=broadcast;
  `grpo.inference.weight_transfer`).

The middleware reaches the engine through ``app.state.engine_client``, which vLLM's own routes use too. It is
added after vLLM's own middleware, so it is the outermost layer: API-key checks (``--api-key``) do not cover
these paths. So `main` binds loopback unless ``--host`` says otherwise, and refuses a host beyond loopback without
a run token (`bind_problem`). What it does check
(`grpo.inference.identity`): the run token of the launcher that started it, on ``/health`` when one is sent and on
every weight-changing call; and `/generate` requests are checked before they reach the engine
(`grpo.inference.request_checks`), so a bad request is a 4xx with the reason, never a 500.

Defaults added unless given on the command line: ``--worker-extension-cls
grpo.inference.worker_extension.WeightSyncExtension`` and ``--logprobs-mode processed_logprobs`` (log-probs of the
distribution actually sampled from, i.e. after temperature, which is what the trainer's importance ratio needs).
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import logging
import os
import sys
import uuid
from typing import Any, Awaitable, Callable

from grpo.inference import identity, weight_transfer
from grpo.inference.request_checks import (
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    MAX_SEQUENCES_ENV,
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
from grpo.inference.weights_check import check_weights_dir

log = logging.getLogger("vllm.grpo_server")
MIDDLEWARE = "grpo.inference.server.GRPOMiddleware"
# grpo-serve's own options (the rest are vLLM's): the bound on sequences (prompts x n) of one /generate request.
SEQUENCES_FLAG = "--max-sequences-per-request"
GRPO_FLAGS = frozenset({SEQUENCES_FLAG})
# Where grpo-serve listens unless --host says otherwise: this machine only.
DEFAULT_HOST = "127.0.0.1"
WORKER_EXTENSION = "grpo.inference.worker_extension.WeightSyncExtension"
# Scope key of the engine request ids a /generate call started (aborted when its client disconnects).
REQUEST_IDS = "grpo.request_ids"
# Initial weight version (the process manager sets it on a restart so versions keep increasing).
VERSION_ENV = "GRPO_WEIGHT_VERSION"


def _state(request) -> Any:
    # Starlette sets scope["app"] to vLLM's FastAPI app before the middleware stack runs.
    return request.app.state


def _version(state) -> int:
    if not hasattr(state, "grpo_weight_version"):
        state.grpo_weight_version = int(os.environ.get(VERSION_ENV, "0"))
    return state.grpo_weight_version


def _upper_version(state) -> int:
    """The newest version whose weights may already be in use: a reload in progress counts as its new version."""
    return max(_version(state), getattr(state, "grpo_weight_version_pending", 0))


def _adapter_versions(state) -> dict[str, int]:
    """The weight version each LoRA adapter was given (POST /grpo/weight_version with a "model"): several trainers
    hot-swapping adapters of their own into one server each count their own versions."""
    if not hasattr(state, "grpo_adapter_versions"):
        state.grpo_adapter_versions = {}
    return state.grpo_adapter_versions


def _request_versions(state, lora: Any) -> tuple[int, int]:
    """(admission version, upper version) of a request: an adapter given a version of its own is that version
    throughout (an adapter never changes once loaded); otherwise the server's."""
    own = _adapter_versions(state).get(lora.lora_name) if lora is not None else None
    if own is not None:
        return own, own
    return _version(state), _upper_version(state)


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
    state = _state(request)
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
    version = _request_versions(state, lora)[0]
    final = await _final_output(engine, prompt_ids, params, lora, ids, priority)
    # Built on a thread: n=128 long samples with 20 log-probs each took seconds of the event loop (/health waited).
    return await asyncio.to_thread(_prompt_response, prompt_ids, final, params, version,
                                   _request_versions(state, lora)[1], tokenizer)


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
    version = _request_versions(state, lora)[0]
    # Tasks, not awaited one by one: each adds its request to the engine at its first step, all before the engine
    # has answered any.
    tasks = [asyncio.ensure_future(_final_output(engine, one, p, lora, ids, priority))
             for one, p in zip(prompt_ids, per_prompt)]
    # Cancelled when the client goes away (GRPOMiddleware): gather cancels each task, and vLLM aborts its request.
    finals = await asyncio.gather(*tasks, return_exceptions=True)
    failed = next(((i, f) for i, f in enumerate(finals) if isinstance(f, BaseException)), None)
    if failed is not None:
        raise PromptFailed(*failed)
    last = _request_versions(state, lora)[1]
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


async def handle_weight_version(request) -> dict:
    """GET: the served version (`?model=<adapter>`: that adapter's own, when it was given one). POST
    {"weight_version": int, "reset_prefix_cache": bool?, "model": str?}: set it after a sync; with "model", the version
    of that LoRA adapter alone (a trainer sharing the server with others), the server's own left as it is."""
    state = _state(request)
    if request.method == "POST":
        body = await request.json()
        if body.get("reset_prefix_cache"):
            # Weights changed under vLLM (shared memory): KV blocks cached before must not be reused.
            await state.engine_client.reset_prefix_cache(reset_running_requests=True)
        if body.get("model"):
            _adapter_versions(state)[str(body["model"])] = int(body["weight_version"])
            return {"weight_version": int(body["weight_version"])}
        state.grpo_weight_version = state.grpo_weight_version_pending = int(body["weight_version"])
        return {"weight_version": _version(state)}
    model = request.query_params.get("model")
    own = _adapter_versions(state).get(model) if model else None
    return {"weight_version": own if own is not None else _version(state)}


async def handle_reload_weights(request) -> dict:
    """POST {"path": dir, "weight_version": int?}: reload HF weights in place on every worker."""
    import time

    state = _state(request)
    engine = state.engine_client
    body = await request.json()
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object: {\"path\": <weights directory>, \"weight_version\": <int>?}")
    new_version = body.get("weight_version", _version(state) + 1)
    if not isinstance(new_version, int) or isinstance(new_version, bool):
        raise BadRequest(f"weight_version must be an integer, got {new_version!r:.80}")
    # Checked here, not by the engine: a directory that is not the served model's crashed the worker, and the engine.
    config = engine.model_config
    path = str(await asyncio.to_thread(check_weights_dir, body.get("path"), str(config.model),
                                       config.hf_config.to_dict()))
    t0 = time.perf_counter()
    # From here on a request that finishes may hold tokens of the new weights (its last_weight_version says so).
    state.grpo_weight_version_pending = new_version
    # Our extension's wrapper of vLLM's worker reload_weights (it also refreshes a tied lm_head).
    await engine.collective_rpc("grpo_reload_weights", kwargs={"path": path})
    # KV blocks cached from the old weights would otherwise be reused for prompts seen before.
    await engine.reset_prefix_cache(reset_running_requests=True)
    state.grpo_weight_version = new_version
    return {"weight_version": state.grpo_weight_version, "seconds": time.perf_counter() - t0}


async def handle_pause(request) -> dict:
    """POST {"mode": "keep"|"wait"|"abort", "clear_cache": bool}: stop scheduling; "keep" (the default) freezes
    in-flight requests until resume. `clear_cache` (default false) also drops the KV and prefix caches: our syncs
    reset the prefix cache themselves once the new weights are in, so clearing it at the pause too only cost time."""
    body = await request.json() if (await request.body()) else {}
    mode, clear_cache = body.get("mode", "keep"), bool(body.get("clear_cache", False))
    engine = _state(request).engine_client
    if mode == "keep" and not clear_cache:
        # The engine core's pause itself. It answers only once no step is in flight (from the engine's idle callback:
        # no request schedulable under PAUSED_ALL, batch queue empty) and schedules no token until resume, so the
        # weights may change as soon as it returns. Tokens computed before it can still reach callers after it
        # returns (request outputs go through another asyncio task); they were computed with the old weights.
        # AsyncLLM.pause_generation adds a fixed 20 ms sleep for that ordering only, and shared_vllm pauses around
        # every optimizer step: the sleep was 20 of the pause's 22 ms on the CPU engine.
        await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    else:
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
    return {"status": "paused"}


async def handle_resume(request) -> dict:
    """POST: resume scheduling after /grpo/pause."""
    await _state(request).engine_client.resume_generation()
    return {"status": "resumed"}


async def handle_rpc(request) -> dict:
    """POST {"method": "grpo_...", "kwargs": {...}}: one worker-extension method on every worker."""
    body = await request.json()
    method = body.get("method", "")
    # Only the extension's own methods: an open collective_rpc would expose every worker internal over HTTP.
    if not method.startswith("grpo_"):
        raise PermissionError(f"only grpo_* worker-extension methods may be called, not {method!r}")
    results = await _state(request).engine_client.collective_rpc(method, kwargs=body.get("kwargs") or {})
    return {"results": results}


async def handle_version(request) -> dict:
    """GET /grpo/version: the handshake (`identity.VERSION_PATH`): what this server is and the limits it applies."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("grpo")
    except PackageNotFoundError:
        package = None
    limits = await model_limits(_state(request).engine_client)
    return {"server": identity.SERVER_NAME, "protocol": identity.PROTOCOL, "package_version": package,
            "max_sequences_per_request": limits.max_sequences_per_request, "max_model_len": limits.max_model_len,
            "scheduling_policy": limits.scheduling_policy, "max_num_seqs": limits.max_num_seqs}


Handler = Callable[[Any], Awaitable[dict]]
ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", identity.VERSION_PATH): handle_version,
    ("POST", "/generate"): handle_generate,
    ("GET", "/grpo/weight_version"): handle_weight_version,
    ("POST", "/grpo/weight_version"): handle_weight_version,
    ("POST", "/grpo/reload_weights"): handle_reload_weights,
    ("POST", "/grpo/pause"): handle_pause,
    ("POST", "/grpo/resume"): handle_resume,
    ("POST", "/grpo/rpc"): handle_rpc,
}


def _weight_transfer_routes() -> None:
    # mode=broadcast: vLLM's NCCL weight-transfer engine (grpo.inference.weight_transfer).
    ROUTES[("POST", "/grpo/weight_transfer/init")] = weight_transfer.handle_init
    ROUTES[("POST", "/grpo/weight_transfer/update")] = weight_transfer.handle_update


_weight_transfer_routes()


class GRPOMiddleware:
    """Pure-ASGI middleware (vLLM `--middleware`) that serves `ROUTES`, checks the run's token on `/health` and on
    the weight-changing calls (`grpo.inference.identity`), and passes everything else to vLLM."""

    def __init__(self, app) -> None:
        self.app = app
        self.token = identity.server_token()
        freeze_startup_heap()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = (scope.get("method", ""), scope.get("path", ""))
        given = identity.header_value(scope.get("headers", []), identity.TOKEN_HEADER)
        if key == ("GET", "/health") and given is not None:
            await self._verified_health(scope, receive, send, given)
            return
        problem = identity.token_problem(self.token, given) if key in identity.PROTECTED else None
        if problem is not None:
            await _json(scope, receive, send, {"error": problem[1]}, problem[0])
            return
        handler = ROUTES.get(key)
        if handler is None:
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request

        if key == ("POST", "/generate"):
            await self._generate(scope, receive, send)
            return
        try:
            body, status = await handler(Request(scope, receive)), 200
        except Exception as e:  # noqa: BLE001 - every error becomes an answer; the server keeps serving
            body, status = error_answer(e)
        await _json(scope, receive, send, body, status)

    async def _generate(self, scope, receive, send) -> None:
        """POST /generate, aborted in the engine when its client disconnects first (a client that timed out or was
        stopped left its sequences generating to the end), its answer serialized on a thread."""
        from starlette.requests import Request

        messages = await _whole_body(receive)
        replay = iter(messages)

        async def receive_body():
            return next(replay)

        scope = {**scope, REQUEST_IDS: []}
        work = asyncio.ensure_future(handle_generate(Request(scope, receive_body)))
        gone = asyncio.ensure_future(_disconnect(receive))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            ids = scope[REQUEST_IDS]
            if ids:
                await _state(Request(scope)).engine_client.abort(ids)
            log.info("grpo /generate: client disconnected; aborted %d engine request(s)", len(ids))
            return
        gone.cancel()
        try:
            body, status = work.result(), 200
        except Exception as e:  # noqa: BLE001 - every error becomes an answer; the server keeps serving
            body, status = error_answer(e)
        await _json(scope, receive, send, body, status, off_loop=True)

    async def _verified_health(self, scope, receive, send, given: str) -> None:
        """GET /health with a token: 403 when it is another run's, else vLLM's answer plus the verified header."""
        if self.token is None:
            await _json(scope, receive, send, {"error": "this server was started without a run token"}, 403)
            return
        problem = identity.token_problem(self.token, given)
        if problem is not None:
            await _json(scope, receive, send, {"error": problem[1]}, 403)
            return

        async def send_verified(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + [(identity.VERIFIED_HEADER.lower().encode(), b"true")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_verified)


def freeze_startup_heap() -> None:
    """Move every object alive now (vLLM's modules, the engine client) out of the garbage collector's reach: a full
    collection walks the whole heap holding the GIL, and one started by a large answer's allocations stalled
    /health for seconds on a 2-core host. vLLM freezes its engine core's heap for the same reason, not its API
    server's, where this middleware is built (on the first request, after start-up)."""
    gc.collect()
    gc.freeze()


def error_answer(e: Exception) -> tuple[dict, int]:
    """The JSON body and HTTP status a handler's exception is answered with: 4xx for what the client must change
    (it must not retry), 500 for the engine's own errors. A failed prompt of a batch (`PromptFailed`) gets its cause's
    status, with a message that names the prompt."""
    cause = e.cause if isinstance(e, PromptFailed) else e
    message = str(e) if isinstance(e, PromptFailed) else describe(e)
    if isinstance(cause, BadRequest):  # the request itself is wrong: the client must change it, not retry
        return {"error": str(e)}, cause.status
    if isinstance(cause, (ValueError, TypeError, KeyError, json.JSONDecodeError)):
        return {"error": message}, 400
    if isinstance(cause, LookupError):
        return {"error": str(e)}, 404
    if isinstance(cause, PermissionError):
        return {"error": str(e)}, 403
    # vLLM's own request validation (not a ValueError in vLLM 0.32) is the client's fault, not the server's.
    return {"error": message}, 400 if type(cause).__name__ == "VLLMValidationError" else 500


async def _json(scope, receive, send, body: dict, status: int, off_loop: bool = False) -> None:
    """Answer `body` as JSON (as Starlette's JSONResponse renders it); `off_loop`: serialized on a thread, so a large
    answer (tens of MB of log-probs) does not hold every other request, /health included."""
    from starlette.responses import JSONResponse, Response

    if not off_loop:
        await JSONResponse(body, status_code=status)(scope, receive, send)
        return
    content = await asyncio.to_thread(render_json, body)
    await Response(content, status_code=status, media_type="application/json")(scope, receive, send)


def render_json(body: Any, depth: int = 4) -> bytes:
    """`body` as Starlette's JSONResponse renders it, dumped piece by piece down to `depth` levels of objects and
    lists: one `json.dumps` call holds the GIL until it returns (a 30 MB answer: seconds without a turn for the
    event loop), many small ones let it run between them."""
    if depth == 0 or not isinstance(body, (dict, list)) or not body:
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    if isinstance(body, list):
        return b"[" + b",".join(render_json(v, depth - 1) for v in body) + b"]"
    # json.dumps writes a non-string key as its str().
    return b"{" + b",".join(render_json(k if isinstance(k, str) else str(k), 0) + b":" + render_json(v, depth - 1)
                            for k, v in body.items()) + b"}"


async def _whole_body(receive) -> list[dict]:
    """The ASGI messages of a request's whole body (read before the handler runs, so `_disconnect` alone listens
    after it)."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


async def _disconnect(receive) -> None:
    """Returns once the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


def with_defaults(argv: list[str]) -> list[str]:
    """vLLM CLI args with our middleware, worker extension, log-prob mode and loopback bind added unless given."""
    argv = list(argv)
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    argv += ["--middleware", MIDDLEWARE]
    if "--host" not in flags:
        # vLLM's own default listens on every interface.
        argv += ["--host", DEFAULT_HOST]
    if "--worker-extension-cls" not in flags:
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    if "--logprobs-mode" not in flags:
        argv += ["--logprobs-mode", "processed_logprobs"]
    return argv


def grpo_options(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` without grpo-serve's own options (`GRPO_FLAGS`, which vLLM's parser would refuse), and their values."""
    rest, own = [], {}
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in GRPO_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"grpo-serve: {flag} needs a value")
                i, value = i + 1, argv[i + 1]
            own[flag] = value
        else:
            rest.append(argv[i])
        i += 1
    return rest, own


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` (`--flag v` or `--flag=v`) in `argv`, the last one given; None when absent."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def is_loopback(host: str) -> bool:
    """True when `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_problem(host: str, token: str | None) -> str | None:
    """Why this server must not start on `host` (None when it may): its weight-changing endpoints (`identity.PROTECTED`)
    are outside vLLM's --api-key check, so beyond loopback they need the run token, or anyone on the network could
    pause the server or load other weights into it."""
    if token is not None or is_loopback(host):
        return None
    return (f"grpo-serve: refusing to listen on {host!r} without {identity.TOKEN_ENV}: its weight-changing endpoints "
            f"(/grpo/reload_weights, /grpo/pause, /grpo/resume, /grpo/weight_version, ...) would answer anyone who "
            f"reaches it. Set {identity.TOKEN_ENV}=<a secret> in its environment (clients send it as "
            f"{identity.TOKEN_HEADER}; a trainer attached to it reads its own {identity.TOKEN_ENV}), or bind "
            f"loopback (--host {DEFAULT_HOST}, the default).")


def port_arg(argv: list[str]) -> int:
    """The --port given to vLLM (its default 8000 when absent)."""
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--port="):
            return int(a.split("=", 1)[1])
    return 8000


HELP_PREFACE = (
    "grpo-serve (python -m grpo.inference.server): vLLM's OpenAI-compatible server plus POST /generate (Atropos'\n"
    "shape, with weight versions) and the /grpo/* weight-sync endpoints a trainer uses. Every option is vLLM's own\n"
    "(below); added unless given: --host 127.0.0.1 (this machine only, where vLLM's own default is every\n"
    "interface), --worker-extension-cls grpo.inference.worker_extension.WeightSyncExtension\n"
    "--logprobs-mode processed_logprobs. An Atropos environment points at http://HOST:PORT (server_type=vllm).\n"
    "\n"
    "GRPO_SERVER_TOKEN (environment): a secret that the weight-changing endpoints (/grpo/reload_weights,\n"
    "/grpo/pause, /grpo/resume, /grpo/weight_version, /grpo/rpc, /grpo/weight_transfer/*, /v1/load_lora_adapter)\n"
    "then require in the X-GRPO-Token header; a trainer attached to this server sends its own GRPO_SERVER_TOKEN.\n"
    "A --host beyond loopback (e.g. 0.0.0.0) is refused without it. Those endpoints are outside vLLM's --api-key.\n"
    "\n"
    f"grpo-serve's own option: {SEQUENCES_FLAG} N: the most sequences (prompts x n) one /generate request may ask\n"
    f"for (default {DEFAULT_MAX_SEQUENCES_PER_REQUEST}; 0: no bound); more is answered 400.\n"
)


def exit_with_launcher() -> bool:
    """When the launcher asked for this server to die with it (PR_SET_PDEATHSIG, as grpo.inference.process does),
    make sure it does: the SIGTERM the kernel sends is lost while vLLM starts (it does not act on SIGTERM then), so a
    trainer SIGKILLed (OOM, a scheduler) during the server's start-up left it running for good, holding its port and
    memory. A daemon thread notices the launcher's exit itself and SIGKILLs this server's process group (its own
    session; else only this process). True when it watches. Linux only; a server started from a shell never asks."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        asked = ctypes.c_int(0)
        if libc.prctl(2, ctypes.byref(asked)) != 0 or asked.value == 0:  # PR_GET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    import signal
    import threading
    import time

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        if os.getpgrp() == os.getpid():  # the leader of its own process group: vLLM's processes are all in it
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="grpo-exit-with-launcher", daemon=True).start()
    return True


# Printed into the server's log when `skip_cpu_aot_compile_cache` turns the cache off; the trainer's start-up progress
# lines quote it as vLLM's latest message.
CPU_AOT_NOTE = "grpo: VLLM_USE_AOT_COMPILE=0 on CPU: vLLM's AOT cache never loads there, torch's inductor cache does"


def skip_cpu_aot_compile_cache() -> bool:
    """On the CPU platform, turn off vLLM's AOT compile cache (VLLM_USE_AOT_COMPILE=0) unless the environment sets
    it. vLLM 0.32 compiles the CPU model with torch's own "inductor" backend (CompilationMode.DYNAMO_TRACE_ONCE),
    yet saves and loads the result as an AOT artifact whose loader calls `finalize_loading`, a method of vLLM's own
    backend only: every start after the first logged "Compiling model again due to a load failure ... 'function'
    object has no attribute 'finalize_loading'", compiled the model again and saved it again. Without AOT, torch's
    own inductor cache serves the next start (issue 44.17 has the timings). True when turned off."""
    if "VLLM_USE_AOT_COMPILE" in os.environ:
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    os.environ["VLLM_USE_AOT_COMPILE"] = "0"  # read by the engine process, which inherits it
    return True


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's api_server with `with_defaults(argv)`, on a port no other process can bind while it runs.

    Runs the module exactly as `python -m vllm.entrypoints.openai.api_server` does: that entry point exists in
    every vLLM release we support (0.26 on the GPU machine, 0.32 CPU here), unlike the newer launcher modules.
    """
    import runpy
    import warnings

    raw, own = grpo_options(sys.argv[1:] if argv is None else argv)
    if "-h" in raw or "--help" in raw:
        print(HELP_PREFACE)
    if own.get(SEQUENCES_FLAG) is not None:
        os.environ[MAX_SEQUENCES_ENV] = own[SEQUENCES_FLAG]  # read by the middleware, in this process
    args = with_defaults(raw)
    problem = bind_problem(flag_value(args, "--host") or DEFAULT_HOST, identity.server_token())
    if problem is not None and "-h" not in raw and "--help" not in raw:
        raise SystemExit(problem)
    exit_with_launcher()
    if skip_cpu_aot_compile_cache():
        print(CPU_AOT_NOTE, file=sys.stderr, flush=True)
    identity.exclusive_listen(port_arg(args))
    # vLLM deprecates running this module as a command (for its `vllm serve`); we run it on purpose (docstring
    # above), so its two warnings would only tell a grpo-serve user to use a command they did not type.
    warnings.filterwarnings("ignore", message=r".*vllm\.entrypoints\.openai\.api_server.*deprecated",
                            category=DeprecationWarning)
    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

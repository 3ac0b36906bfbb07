"""The /grpo/* endpoints of the inference server that a trainer's weight sync calls: the served version, an in-place
reload of HF weights, pause and resume of generation, and the worker extension's methods (`grpo_*`)."""

from __future__ import annotations

import asyncio

from grpo.inference.request_checks import BadRequest
from grpo.inference.served_version import adapter_versions, app_state, served_version
from grpo.inference.weights_check import check_weights_dir


async def handle_weight_version(request) -> dict:
    """GET: the served version (`?model=<adapter>`: that adapter's own, when it was given one). POST
    {"weight_version": int, "reset_prefix_cache": bool?, "model": str?}: set it after a sync; with "model", the version
    of that LoRA adapter alone (a trainer sharing the server with others), the server's own left as it is."""
    state = app_state(request)
    if request.method == "POST":
        body = await request.json()
        if body.get("reset_prefix_cache"):
            # Weights changed under vLLM (shared memory): KV blocks cached before must not be reused.
            await state.engine_client.reset_prefix_cache(reset_running_requests=True)
        if body.get("model"):
            adapter_versions(state)[str(body["model"])] = int(body["weight_version"])
            return {"weight_version": int(body["weight_version"])}
        state.grpo_weight_version = state.grpo_weight_version_pending = int(body["weight_version"])
        return {"weight_version": served_version(state)}
    model = request.query_params.get("model")
    own = adapter_versions(state).get(model) if model else None
    return {"weight_version": own if own is not None else served_version(state)}


async def handle_reload_weights(request) -> dict:
    """POST {"path": dir, "weight_version": int?}: reload HF weights in place on every worker."""
    import time

    state = app_state(request)
    engine = state.engine_client
    body = await request.json()
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object: {\"path\": <weights directory>, \"weight_version\": <int>?}")
    new_version = body.get("weight_version", served_version(state) + 1)
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
    engine = app_state(request).engine_client
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
    await app_state(request).engine_client.resume_generation()
    return {"status": "resumed"}


async def handle_rpc(request) -> dict:
    """POST {"method": "grpo_...", "kwargs": {...}}: one worker-extension method on every worker."""
    body = await request.json()
    method = body.get("method", "")
    # Only the extension's own methods: an open collective_rpc would expose every worker internal over HTTP.
    if not method.startswith("grpo_"):
        raise PermissionError(f"only grpo_* worker-extension methods may be called, not {method!r}")
    results = await app_state(request).engine_client.collective_rpc(method, kwargs=body.get("kwargs") or {})
    return {"results": results}


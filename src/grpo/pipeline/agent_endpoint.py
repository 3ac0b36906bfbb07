"""An OpenAI-compatible endpoint in front of the run's vLLM server that records every token (grpo.pipeline.agents).

An agent written against the OpenAI chat API (the `openai` SDK, or any client of it) is pointed at a base URL of its
episode, ``http://127.0.0.1:<port>/episodes/<id>/v1``, and calls

- ``POST .../chat/completions``: the messages (and tools) are rendered with the chat template and tokenized here
  (grpo.pipeline.chat_prompts), the token ids are sampled through the run's server (its token-in ``/generate``,
  through the pipeline's `sample` function: the generation gate, the replicas, the seeds), and the answer comes back
  as an OpenAI chat completion, tool calls parsed from the text (grpo.pipeline.tool_calls);
- ``POST .../completions``: a text prompt, tokenized whole (no template);
- ``GET .../models``: the one model the run serves (any `model` name a request gives is answered by it).

Each request is recorded on its episode (`EpisodeLog`) as a `ModelCall`: the exact prompt ids sampled from, the
sampled ids with their log-probs, the weight versions. Sampling settings are the run's: `temperature` and `top_p`
other than the run's, `n` > 1, `stop` and streaming are refused (HTTP 400, OpenAI's error shape); `max_tokens` is
capped by `data.max_new_tokens` and by what is left of `max_episode_tokens`. vLLM's `structured_outputs` passes
through (``extra_body``). The request's `seed` is ignored: each call is seeded from the episode's seed and its index.

The server runs on an event loop of its own in a daemon thread, where the agents' rollouts run too (`run`); sampling
blocks a worker thread of a pool, never the loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from grpo.inference.client import Completion
from grpo.pipeline.agent_samples import ModelCall
from grpo.pipeline.chat_prompts import ChatPrompts, RenderedCall
from grpo.pipeline.tool_calls import ToolParser

# sample(prompt ids, max_tokens, seed or None, extra sampling keys) -> one Completion; blocking.
SampleFn = Callable[[list[int], int, Optional[int], dict[str, Any]], Completion]
# Sampling keys a request may carry that the endpoint passes on to vLLM.
PASSED_THROUGH = ("structured_outputs",)


class RequestRefused(ValueError):
    """A request the endpoint does not serve; the message says why (an HTTP 400 in OpenAI's error shape)."""


@dataclass
class EpisodeLog:
    """What one episode's requests recorded: `calls` (ModelCall, in the order they finished), `requests` (each
    call's request body as received), and how many requests were refused."""

    id: str
    seed: Optional[int]
    # Requests the episode may send (0: no limit); a later one is refused.
    max_requests: int = 0
    calls: list[ModelCall] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    rendered: list[RenderedCall] = field(default_factory=list)
    refused: int = 0
    tool_calls: int = 0
    started: int = 0


def call_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of an episode's call `index`: a function of the episode's seed and the index."""
    if seed is None:
        return None
    return int(hashlib.sha256(f"grpo-agent-call:{seed}:{index}".encode()).hexdigest()[:8], 16) % (2**31)


def _error(message: str, status: int = 400, code: str = "invalid_request") -> tuple[dict[str, Any], int]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}, status


@dataclass(frozen=True)
class SamplingRules:
    """The run's sampling settings a request must agree with, and the token limits it is held to."""

    temperature: float
    top_p: float
    max_new_tokens: int
    max_episode_tokens: int

    def max_tokens(self, body: dict[str, Any], prompt_len: int) -> int:
        """The tokens a request may sample: its own cap, data.max_new_tokens and what the episode has left."""
        for key, ours in (("temperature", self.temperature), ("top_p", self.top_p)):
            if body.get(key) is not None and abs(float(body[key]) - ours) > 1e-9:
                raise RequestRefused(f"{key}={body[key]} differs from the run's data.{key}={ours}: the trainer's "
                                     f"log-probs are of data.{key}'s distribution; leave {key} out of the request")
        if int(body.get("n") or 1) != 1:
            raise RequestRefused("n > 1 is not served: each request is one sample of the episode")
        if body.get("stream"):
            raise RequestRefused("streaming is not served by the training endpoint; set stream=False")
        if body.get("stop"):
            raise RequestRefused("stop strings are not served (the trained tokens must be the sampled ones); end turns "
                                 "at the end-of-turn token")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_new_tokens
        left = self.max_episode_tokens - prompt_len
        if left < 1:
            raise RequestRefused(f"the prompt has {prompt_len} tokens, no room left within max_episode_tokens="
                                 f"{self.max_episode_tokens}")
        return max(1, min(int(asked), self.max_new_tokens, left))


class AgentEndpoint:
    """The recording OpenAI-compatible server (module docstring). `lock` guards the tokenizer (shared with the
    pipeline's other users); `workers` bounds the requests sampled at once."""

    def __init__(self, prompts: ChatPrompts, tool_parser: ToolParser, sample: SampleFn, rules: SamplingRules,
                 model_name: str, lock: Optional[AbstractContextManager] = None, host: str = "127.0.0.1",
                 workers: int = 64) -> None:
        self.prompts, self.tool_parser, self.sample, self.rules = prompts, tool_parser, sample, rules
        self.model_name = model_name
        self.lock = lock if lock is not None else threading.Lock()
        self.host = host
        self.episodes: dict[str, EpisodeLog] = {}
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-sample")
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner: Any = None
        self.port = 0

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Bind a free loopback port and serve on a loop of its own (returns once it listens)."""
        ready: Future = Future()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._listen())
                ready.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller of start()
                ready.set_exception(e)
                return
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="agent-endpoint", daemon=True)
        self._thread.start()
        ready.result(timeout=60)

    async def _listen(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{episode}/v1/completions", self._completion)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    def close(self) -> None:
        """Cancel the episodes still running (a caller waiting on `run`'s future gets CancelledError), stop serving."""
        if self._loop is None:
            return

        def cancel_all() -> None:
            for task in asyncio.all_tasks(self._loop):
                task.cancel()

        self._loop.call_soon_threadsafe(cancel_all)
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self, coroutine: Awaitable[Any]) -> Future:
        """Run `coroutine` on the endpoint's loop (where the agents' clients live); a concurrent Future."""
        assert self._loop is not None, "AgentEndpoint.start() was not called"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    # ------------------------------------------------------------------ episodes
    def open_episode(self, seed: Optional[int], max_requests: int = 0) -> EpisodeLog:
        log = EpisodeLog(f"e{next(self._ids)}", seed, max_requests)
        self.episodes[log.id] = log
        return log

    def base_url(self, log: EpisodeLog) -> str:
        """The OpenAI base URL of episode `log` (what `openai.AsyncOpenAI(base_url=...)` takes)."""
        return f"{self.url}/episodes/{log.id}/v1"

    def close_episode(self, log: EpisodeLog) -> EpisodeLog:
        """Stop serving `log`'s URL (a late request gets 404) and hand back its record."""
        self.episodes.pop(log.id, None)
        return log

    # ------------------------------------------------------------------ routes
    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "grpo"}]})

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, "chat")

    async def _completion(self, request: Any) -> Any:
        return await self._serve(request, "completion")

    async def _serve(self, request: Any, kind: str) -> Any:
        from aiohttp import web

        log = self.episodes.get(request.match_info["episode"])
        if log is None:
            body, status = _error(f"no episode {request.match_info['episode']!r} is open (it ended, or its URL is "
                                  "from another run)", 404, "not_found")
            return web.json_response(body, status=status)
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestRefused("the request body must be a JSON object")
            index = log.started
            if 0 < log.max_requests <= index:
                raise RequestRefused(f"the episode has sent its data.max_requests={log.max_requests} requests")
            log.started += 1
            answer = await asyncio.get_running_loop().run_in_executor(self._pool, self._answer, log, body, kind, index)
            return web.json_response(answer)
        except (RequestRefused, json.JSONDecodeError) as e:
            log.refused += 1
            body, status = _error(str(e))
            return web.json_response(body, status=status)

    # ------------------------------------------------------------------ one request (a worker thread)
    def _prompt(self, log: EpisodeLog, body: dict[str, Any], kind: str) -> tuple[str, list[int]]:
        with self.lock:
            if kind == "completion":
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise RequestRefused("'prompt' must be one string")
                return prompt, list(self.prompts.tokenizer.encode(prompt, add_special_tokens=False))
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestRefused("'messages' must be a non-empty list")
            if body.get("tool_choice") not in (None, "auto", "none"):
                raise RequestRefused(f"tool_choice={body['tool_choice']!r} is not served (auto or none)")
            try:
                text = self.prompts.render(messages, body.get("tools"))
            except ValueError as e:
                raise RequestRefused(str(e)) from None
            except Exception as e:  # the template's own error (a message it cannot render)
                raise RequestRefused(f"the chat template could not render the messages: {e}") from None
            return text, self.prompts.prompt_ids(text, list(log.rendered))

    def _answer(self, log: EpisodeLog, body: dict[str, Any], kind: str, index: int) -> dict[str, Any]:
        text, prompt_ids = self._prompt(log, body, kind)
        max_tokens = self.rules.max_tokens(body, len(prompt_ids))
        extra = {k: body[k] for k in PASSED_THROUGH if body.get(k) is not None}
        c = self.sample(prompt_ids, max_tokens, call_seed(log.seed, index), extra)
        call = ModelCall(tuple(prompt_ids), tuple(c.token_ids), None if c.logprobs is None else tuple(c.logprobs),
                         c.finish_reason, c.weight_version, c.last_weight_version, kind)
        with self.lock:
            completion_text = self.prompts.completion_text(c.token_ids)
            ended = c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in self._special_ids()
            content = self.prompts.completion_text(c.token_ids[:-1]) if ended else completion_text
        log.calls.append(call)
        log.requests.append(body)
        log.rendered.append(RenderedCall(text, completion_text, call.prompt_ids, call.completion_ids))
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(c.token_ids),
                 "total_tokens": len(prompt_ids) + len(c.token_ids)}
        head = {"id": f"grpo-{log.id}-{index}", "created": int(time.time()), "model": body.get("model") or self.model_name,
                "usage": usage}
        if kind == "completion":
            return {**head, "object": "text_completion",
                    "choices": [{"index": 0, "text": content, "finish_reason": c.finish_reason, "logprobs": None}]}
        return {**head, "object": "chat.completion", "choices": [self._chat_choice(log, body, content, c, index)]}

    def _chat_choice(self, log: EpisodeLog, body: dict[str, Any], content: str, c: Completion, index: int
                     ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = c.finish_reason
        if body.get("tools") and body.get("tool_choice") != "none" and finish == "stop":
            parsed = self.tool_parser.parse(content, body, f"call_{log.id}_{index}")
            if parsed.tool_calls:
                message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
                finish = "tool_calls"
                log.tool_calls += len(parsed.tool_calls)
        return {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}

    def _special_ids(self) -> set[int]:
        return set(getattr(self.prompts.tokenizer, "all_special_ids", []) or [])

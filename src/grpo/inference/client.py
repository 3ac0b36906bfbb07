"""HTTP client of the inference server: our Atropos-style /generate plus vLLM's own endpoints.

Synchronous (requests) on purpose: the trainer and the local rollout pipeline are synchronous, and vLLM batches
concurrent requests itself, so `generate` fans prompts out over a small thread pool instead of an event loop.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests

from grpo.inference.identity import PROTOCOL, SERVER_NAME, TOKEN_HEADER, VERSION_PATH
from grpo.inference.request_checks import DEFAULT_MAX_SEQUENCES_PER_REQUEST

log = logging.getLogger(__name__)

# What a grpo server without the batched /generate form answers it (HTTP 400): the client then sends one request per
# prompt.
OLD_SERVER_ANSWER = "body must be a JSON object with a 'prompt'\""


def sampling_payload(n: int, max_tokens: int, temperature: float, top_p: float, model: str | None, logprobs: bool,
                     sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling keys of a /generate body, single or batched (`logprobs=False` asks for none: null)."""
    payload = {"logprobs": 0 if logprobs else None, "n": n, "max_tokens": max_tokens, "temperature": temperature,
               "top_p": top_p, **sampling}
    if model is not None:
        payload["model"] = model
    return payload


class InferenceServerError(RuntimeError):
    """The server is unreachable after the retries, or answered with an error."""


class ServerUnreachable(InferenceServerError):
    """No answer after the retries (connection refused or reset, timeout, 503): the server was down or restarting."""


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    token_ids: list[int]
    # Log-prob of each generated token under the served weights (one per token); None when not asked for.
    logprobs: list[float] | None
    # "stop" | "length" | "abort" (vLLM's finish reasons).
    finish_reason: str | None
    text: str = ""
    # Weight version served when the request was admitted (-1 when the server does not report one): at most the
    # version of any of its tokens.
    weight_version: int = -1
    # Weight version served when it finished (-1 when not reported): at least the version of any of its tokens.
    last_weight_version: int = -1


@dataclass(frozen=True)
class Endpoint:
    """What a caller needs to sample from the policy being trained: where the servers are, which model name to put
    in requests (the adapter name in LoRA modes; None = the server's default) and the weight version they serve."""

    base_url: str
    model: str | None
    version: int
    # Every replica to spread requests over (grpo.inference.routing.RoutedClient); empty = `base_url` alone.
    replica_urls: tuple[str, ...] = ()
    # The load those replicas carry (a grpo.inference.routing.ReplicaLoad shared by the run's routers); None = a
    # router counts its own requests only.
    load: Any = None

    @property
    def urls(self) -> tuple[str, ...]:
        """The replicas to sample from (at least `base_url`)."""
        return self.replica_urls or (self.base_url,)


def parse_generate_response(body: dict[str, Any]) -> list[Completion]:
    """Turn a /generate answer (the shape Atropos' VLLMServer reads) into Completions."""
    version = int(body.get("weight_version", -1))
    last_version = int(body.get("last_weight_version", -1))
    texts = body.get("text") or [""] * len(body["logprobs"])
    token_ids = body.get("token_ids") or [None] * len(body["logprobs"])
    out = []
    for per_pos, reason, text, tids in zip(body["logprobs"], body["finish_reasons"], texts, token_ids):
        if per_pos is None:  # asked without log-probs: the ids come from "token_ids"
            ids, lps = [int(t) for t in tids], None
        else:
            # Each position is a one-element list [{token_id: logprob}]; JSON turned the id into a string.
            ids = [int(next(iter(p[0]))) for p in per_pos]
            lps = [float(next(iter(p[0].values()))) for p in per_pos]
        out.append(Completion(token_ids=ids, logprobs=lps, finish_reason=reason, text=text, weight_version=version,
                              last_weight_version=last_version))
    return out


class InferenceClient:
    """Client of one inference server (`python -m grpo.inference.server` or any vLLM server for the
    OpenAI endpoints).

    Connection errors and 503s are retried `retries` times with exponential backoff; after that an
    `InferenceServerError` says the server is down. 4xx answers are raised at once with the server's message.
    `token`: the run token of a server `VLLMServer` started (`server.token`), sent on every request as
    `X-GRPO-Token`; the weight-changing endpoints need it. `prompts_per_request`: how many prompts `generate` puts
    in one batched /generate request (0: a request per prompt).
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency: int = 64,
        token: str | None = None,
        prompts_per_request: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        # Prompts `generate` sends in one batched /generate request (0: one request per prompt, Atropos' form). Turned
        # to 0 when the server turns the batched form down (a grpo server older than it).
        self.prompts_per_request = prompts_per_request
        self._session = requests.Session()
        # The default pool (10) would serialise a wide fan-out.
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=max_concurrency)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        if token is not None:
            # The run token of a server our launcher started: its weight-changing endpoints refuse calls without it.
            self._session.headers[TOKEN_HEADER] = token

    # ------------------------------------------------------------------ transport
    def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> requests.Response:
        url = self.base_url + path
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                r = self._session.request(method, url, json=json, timeout=timeout or self.timeout)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = e
            else:
                if r.status_code == 503 and attempt < self.retries:
                    last = InferenceServerError(f"{method} {url}: 503 {r.text[:500]}")
                elif r.status_code >= 400:
                    raise InferenceServerError(f"{method} {url}: HTTP {r.status_code}: {r.text[:2000]}")
                else:
                    return r
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise ServerUnreachable(
            f"inference server at {self.base_url} is not answering ({method} {path}) after "
            f"{self.retries + 1} attempts: {last}"
        )

    def _post(self, path: str, payload: dict, timeout: float | None = None) -> Any:
        r = self._request("POST", path, json=payload, timeout=timeout)
        return r.json() if r.content else None

    def _watched_post(self, path: str, payload: dict) -> requests.Response:
        """POST of a weight update (a sync's reload or adapter swap): given up on, like generation, when the server
        stops answering /health meanwhile (its API answers /health while the engine reloads)."""
        return self._while_healthy(lambda _: self._request("POST", path, json=payload), 1, f"requests ({path})")[0]

    # ------------------------------------------------------------------ health
    def health(self, timeout: float = 5.0) -> bool:
        """True when GET /health answers 200 (one attempt, no retries)."""
        try:
            return self._session.get(self.base_url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def server_info(self) -> dict[str, Any]:
        """The server's handshake answer (GET /grpo/version: {"server": "grpo", "protocol": int, ...}); an
        InferenceServerError saying what answered instead when it is not a grpo server."""
        r = self._session.get(self.base_url + VERSION_PATH, timeout=30)
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code != 200 or not isinstance(body, dict) or body.get("server") != SERVER_NAME:
            raise InferenceServerError(f"{self.base_url} is not a grpo server: GET {VERSION_PATH} answered HTTP "
                                       f"{r.status_code} {r.text[:200]!r}")
        if body.get("protocol") != PROTOCOL:
            raise InferenceServerError(f"the grpo server at {self.base_url} speaks protocol {body.get('protocol')}, "
                                       f"this trainer {PROTOCOL}: run the same grpo version on both sides")
        return body

    # ------------------------------------------------------------------ generation
    def generate_one(
        self,
        prompt: list[int],
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        model: str | None = None,
        logprobs: bool = True,
        **sampling: Any,
    ) -> list[Completion]:
        """`n` completions of one token-id prompt through POST /generate; `logprobs=False` asks for none (each
        Completion's `logprobs` is then None), which spares vLLM their work on every decode step."""
        payload = {"prompt": {"prompt_token_ids": [int(t) for t in prompt]},
                   **sampling_payload(n, max_tokens, temperature, top_p, model, logprobs, sampling)}
        return parse_generate_response(self._post("/generate", payload))

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        model: str | None = None,
        max_in_flight: int | None = None,
        **sampling: Any,
    ) -> list[list[Completion]]:
        """`n` completions for each prompt; result[i] belongs to prompts[i].

        Prompts go out `prompts_per_request` at a time in batched /generate requests (concurrent when there are
        several), so the server hands each batch to the engine at once and one step's prompts share the engine's
        steps. One concurrent HTTP request per prompt (`prompts_per_request=0`, Atropos' form) reaches the engine
        over several of its steps: on the skill task's step 7-13 engine steps instead of 5.4, 0.095-0.114 s per call
        instead of 0.080-0.082 (bench/generate_overhead.py, bench/README.md). A `seed` in `sampling` is the call's base seed:
        prompt i is sampled with `seed + i * n` (vLLM gives sample k of a request `seed + k`), so every sample of
        the call draws from its own random stream, the same in either form. One seed for every prompt would give
        sample k of each prompt the same draws: on a model whose next-token distribution barely depends on the
        prompt (early in training), the batch's prompts then get near-identical completions. `max_in_flight`: the most
        sequences (prompts x n) of this call out at once (at least one prompt's n); None: `max_concurrency` requests.
        """
        if not prompts:
            return []
        base_seed = sampling.pop("seed", None)
        if self.prompts_per_request > 0:
            try:
                return self._generate_batched(prompts, n, max_tokens, temperature, top_p, model, base_seed, sampling,
                                              max_in_flight)
            except InferenceServerError as e:
                if OLD_SERVER_ANSWER not in str(e):
                    raise
                # A server without the batched form (a grpo server older than it): one request per prompt from now on.
                log.warning("inference server at %s has no batched /generate; sending one request per prompt",
                            self.base_url)
                self.prompts_per_request = 0

        def one(i: int) -> list[Completion]:
            seed = {} if base_seed is None else {"seed": (int(base_seed) + i * n) % (2**63)}
            return self.generate_one(prompts[i], n, max_tokens, temperature, top_p, model, **seed, **sampling)

        workers = None if max_in_flight is None else max(1, max_in_flight // max(int(n), 1))
        return self._while_healthy(one, len(prompts), "generation requests", workers)

    def _generate_batched(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float,
                          model: str | None, base_seed: int | None, sampling: dict[str, Any],
                          max_in_flight: int | None = None) -> list[list[Completion]]:
        """`generate` through batched /generate requests of up to `prompts_per_request` prompts each (fewer, and
        fewer at once, within `max_in_flight` sequences)."""
        rest = {k: v for k, v in sampling.items() if k != "logprobs"}
        common = sampling_payload(n, max_tokens, temperature, top_p, model, sampling.get("logprobs", True), rest)
        # Within the server's bound on sequences per request (its default; a lower one is the server's to say).
        per_request = min(self.max_sequences_per_request, max_in_flight or self.max_sequences_per_request)
        size = max(1, min(self.prompts_per_request, per_request // max(int(n), 1)))
        workers = None if max_in_flight is None else max(1, max_in_flight // (size * max(int(n), 1)))
        starts = list(range(0, len(prompts), size))

        def batch(b: int) -> list[list[Completion]]:
            first = starts[b]
            payload: dict[str, Any] = {"prompts": [[int(t) for t in p] for p in prompts[first:first + size]], **common}
            if base_seed is not None:
                payload["seed"] = (int(base_seed) + first * n) % (2**63)  # the server adds i * n for its prompt i
            return [parse_generate_response(r) for r in self._post("/generate", payload)["results"]]

        what = f"generation requests ({len(prompts)} prompts, up to {size} per request)"
        return [group for chunk in self._while_healthy(batch, len(starts), what, workers) for group in chunk]

    # Sequences (prompts x n) `generate` puts in one batched request at most: the server's default bound.
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST

    # While generation requests are out: how often /health is asked, and how long it may take to answer (as the
    # trainer's health check before each step). A hung server (stopped, deadlocked) accepts the requests and never
    # answers them: without this they waited for `timeout` (600 s) and each retry, and Ctrl-C waited with them.
    health_every_s: float = 10.0
    health_timeout_s: float = 10.0

    def _while_healthy(self, one: Any, n: int, what: str, workers: int | None = None) -> list[Any]:
        """`[one(i) for i in range(n)]`, run concurrently (at most `workers` at once, within `max_concurrency`);
        raises ServerUnreachable when the server stops answering /health meanwhile. The requests left behind end when
        the server is restarted or stopped (their connection closes) or at their timeout; nothing waits for them."""
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, n, workers or n))
        try:
            futures = [pool.submit(one, i) for i in range(n)]
            while True:
                done, pending = wait(futures, timeout=self.health_every_s, return_when=FIRST_EXCEPTION)
                error = next((f.exception() for f in done if f.exception() is not None), None)
                if error is not None:
                    raise error
                if not pending:
                    return [f.result() for f in futures]
                if not self.health(timeout=self.health_timeout_s):
                    raise ServerUnreachable(
                        f"inference server at {self.base_url} stopped answering /health (within "
                        f"{self.health_timeout_s:g} s) while {len(pending)} of {n} {what} were out: hung or dead")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def prompt_logprobs(self, tokens: list[int], model: str | None = None) -> list[float]:
        """Log-prob of tokens[i] given tokens[:i] for i = 1..len-1 (len(tokens) - 1 values), from the raw logits.

        Uses vLLM's /v1/completions with `prompt_logprobs=0` (the actual token's log-prob at every prompt
        position), so it also works against a plain vLLM server.
        """
        if len(tokens) < 2:
            raise ValueError("prompt_logprobs needs at least two tokens")
        payload: dict[str, Any] = {
            "prompt": [int(t) for t in tokens],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        if model is not None:
            payload["model"] = model
        else:
            payload["model"] = self.default_model()
        body = self._post("/v1/completions", payload)
        entries = body["choices"][0]["prompt_logprobs"]
        out = []
        # Position 0 has no prefix (None); each later entry maps token id -> {"logprob", "rank", ...}.
        for tok, entry in zip(tokens[1:], entries[1:]):
            out.append(float(entry[str(int(tok))]["logprob"]))
        return out

    # ------------------------------------------------------------------ models and LoRA
    def models(self) -> list[str]:
        """Names served (base model first, then loaded LoRA adapters)."""
        return [m["id"] for m in self._request("GET", "/v1/models").json()["data"]]

    def default_model(self) -> str:
        """The base model's served name."""
        if not hasattr(self, "_default_model"):
            self._default_model = self.models()[0]
        return self._default_model

    def load_lora(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Load a PEFT adapter directory under `name` (needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the server)."""
        payload: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
        if load_inplace:
            payload["load_inplace"] = True
        self._watched_post("/v1/load_lora_adapter", payload)

    def unload_lora(self, name: str) -> None:
        """Unload the adapter `name`."""
        self._watched_post("/v1/unload_lora_adapter", {"lora_name": name})

    # ------------------------------------------------------------------ grpo extensions (our server only)
    def weight_version(self, model: str | None = None) -> int:
        """Weight version the server reports on /generate (for requests naming LoRA adapter `model`, when given)."""
        path = "/grpo/weight_version" + (f"?model={quote(model)}" if model else "")
        return int(self._request("GET", path).json()["weight_version"])

    def set_weight_version(self, version: int, reset_prefix_cache: bool = False, model: str | None = None) -> None:
        """Tell the server which weight version it serves now (after a LoRA swap or a restart); with
        `reset_prefix_cache`, KV blocks cached under older weights are dropped too (weights changed in place). With
        `model` (a LoRA adapter's name): the version of that adapter alone, which requests naming it report."""
        payload: dict[str, Any] = {"weight_version": int(version)}
        if reset_prefix_cache:
            payload["reset_prefix_cache"] = True
        if model:
            payload["model"] = model
        self._watched_post("/grpo/weight_version", payload)

    def reload_weights(self, path: str, version: int | None = None) -> dict:
        """Reload full HF weights from `path` in place on every worker; bumps the served version."""
        payload: dict[str, Any] = {"path": str(path)}
        if version is not None:
            payload["weight_version"] = int(version)
        r = self._watched_post("/grpo/reload_weights", payload)
        return r.json() if r.content else None

    def pause(self) -> None:
        """Pause generation (in-flight requests wait) until resume()."""
        self._post("/grpo/pause", {})

    def resume(self) -> None:
        """Resume generation after pause()."""
        self._post("/grpo/resume", {})

    def rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """Call worker-extension method `method` (a `grpo_*` name) with `kwargs` (JSON values) on every vLLM
        worker; their results in order."""
        return self._post("/grpo/rpc", {"method": method, "kwargs": kwargs})["results"]

    def weight_transfer_init(self, info: dict, timeout: float | None = None) -> Any:
        """Have every worker join the NCCL weight-transfer group `info` describes (mode=broadcast). Blocks until
        the trainer joins too, so callers run it beside their own side of the rendezvous."""
        return self._post("/grpo/weight_transfer/init", info, timeout)

    def weight_transfer_update(self, info: dict, timeout: float | None = None) -> Any:
        """Have every worker receive one weight update by NCCL broadcast (mode=broadcast); blocks until the
        trainer has sent every bucket."""
        return self._post("/grpo/weight_transfer/update", info, timeout)

    def close(self) -> None:
        """Close the connection pool."""
        self._session.close()

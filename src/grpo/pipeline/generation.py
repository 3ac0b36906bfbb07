"""The one way a pipeline or an evaluator samples the policy being trained: a `GenerationHandle`.

The build makes one per run (grpo.build.generation_handle) from what the sync strategy serves and hands it to the data
pipeline (`PipelineContext.generation`) and the evaluator (`EvalContext.generation`). A caller asks it to `generate`
token ids; the handle does the rest of the server access, the same for every caller:

- where: the endpoint (replicas, served model or LoRA adapter name, weight version) is read anew for every call, inside
  the server's gate, so a restart the gate waited for may have moved the server and a sync advanced the version;
- how: one `RoutedClient` per thread (a requests.Session is not meant to be shared) over the endpoint's replicas, by
  load (grpo.inference.routing), with the client's retries and health watch; rebuilt when the replicas change;
- what comes back: `n` completions per prompt, log-probs exactly when asked, and the weight versions the server
  reports at admission and at finish (grpo.inference.server's /generate); anything else is a RuntimeError naming
  the server.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, Callable, Optional

from grpo.inference.client import Completion, Endpoint
from grpo.inference.routing import RoutedClient, routed_client
from grpo.serving.gate import GenerationGate


def check_completions(outs: list[list[Completion]], n: int, logprobs: bool, url: str) -> None:
    """Refuse an answer that is not what the request asked for: `n` completions per prompt, log-probs (one per token)
    exactly when `logprobs`, and the weight versions grpo's /generate reports."""
    for completions in outs:
        if len(completions) != n:
            raise RuntimeError(f"inference server at {url} returned {len(completions)} completions, asked for {n}")
        for c in completions:
            if (c.logprobs is None) == logprobs:
                raise RuntimeError(f"inference server at {url} returned "
                                   f"{'no log-probs though' if logprobs else 'log-probs though not'} asked for them")
            if c.logprobs is not None and len(c.logprobs) != len(c.token_ids):
                raise RuntimeError(f"inference server at {url} returned {len(c.logprobs)} log-probs for "
                                   f"{len(c.token_ids)} tokens")
            if c.weight_version < 0 or c.last_weight_version < c.weight_version:
                raise RuntimeError(
                    f"inference server at {url} reported weight versions {c.weight_version} .. "
                    f"{c.last_weight_version} for a completion; rollouts and evaluations need grpo.inference.server's "
                    "/generate, which reports the version at admission and at finish"
                )


class GenerationHandle:
    """Samples the policy being trained from the run's server (module docstring). `endpoint`: returns the server to
    sample from now (the sync strategy's `endpoint`); `gate`: the server's GenerationGate every call passes (None: no
    sync to coordinate with); `client_kwargs`: what each thread's client is built with (e.g. `max_concurrency`).
    Thread-safe; `close` closes every thread's client."""

    def __init__(self, endpoint: Callable[[], Endpoint], gate: Optional[GenerationGate] = None,
                 **client_kwargs: Any) -> None:
        self._endpoint = endpoint
        self.gate = gate
        self.client_kwargs = client_kwargs
        self._local = threading.local()
        self._clients: list[RoutedClient] = []
        self._lock = threading.Lock()

    def endpoint(self) -> Endpoint:
        """The server sampled from now (its replicas, served model name and weight version)."""
        return self._endpoint()

    def version(self) -> int:
        """The weight version the server serves now."""
        return int(self._endpoint().version)

    def with_clients(self, gated: bool = True, **client_kwargs: Any) -> GenerationHandle:
        """A handle on the same server with clients of its own, built with `client_kwargs` (the evaluator's
        `max_concurrency`); `gated=False`: its calls pass no gate (close it yourself)."""
        return GenerationHandle(self._endpoint, self.gate if gated else None, **client_kwargs)

    def generate(self, prompts: list[list[int]], n: int = 1, *, logprobs: bool, **sampling: Any
                 ) -> list[list[Completion]]:
        """`n` completions of every token-id prompt from the policy served now (result[i] belongs to prompts[i]),
        their token ids only (callers decode them: the server need not detokenize). `sampling`: the rest of
        `InferenceClient.generate`'s keys (max_tokens, temperature, top_p, seed, min_tokens, priority, ...)."""
        # Through the sync's gate: a restarting sync waits for these requests, and holds new ones until it is done.
        with self.gate.generating() if self.gate is not None else nullcontext():
            endpoint = self._endpoint()  # inside the gate: a restart it waited for may have moved the server
            outs = self.client(endpoint).generate(prompts, n=n, model=endpoint.model, detokenize=False,
                                                  logprobs=logprobs, **sampling)
        check_completions(outs, n, logprobs, endpoint.base_url)
        return outs

    def client(self, endpoint: Optional[Endpoint] = None) -> RoutedClient:
        """This thread's client of `endpoint`'s replicas (None: the current endpoint's); a new one when they changed
        (a restart may take one out for a while, or move them)."""
        endpoint = endpoint if endpoint is not None else self._endpoint()
        if getattr(self._local, "urls", None) != endpoint.urls:
            with self._lock:
                old = getattr(self._local, "client", None)
                if old is not None:
                    old.close()
                    self._clients.remove(old)
                self._local.client = routed_client(endpoint, **self.client_kwargs)
                self._clients.append(self._local.client)
            self._local.urls = endpoint.urls
        return self._local.client

    def close(self) -> None:
        """Close every thread's client (a later call builds new ones)."""
        with self._lock:
            clients, self._clients = self._clients, []
            self._local = threading.local()
        for client in clients:
            client.close()

"""Generation spread over several inference servers (replicas) by load: least outstanding requests first.

`ReplicaLoad` counts, per server URL, the generation requests in flight (one request = one prompt with its `n`
completions) and those sent so far; the run shares one instance between every thread and pipeline that generates,
so the counts are the load each replica carries. `RoutedClient` has `InferenceClient.generate`'s signature: it
splits a call's prompts into one contiguous share per replica, sized so the outstanding counts even out (water
filling), and sends the shares at once. A prompt's `n` completions stay in one request, so a group runs on one
replica and shares its prompt's cached prefix. A share whose replica stops answering is sent again to another one
(at most once per replica); the dead one is the server's to restart (grpo.serving.server).

Seeds are those of one server: share `[start, start + k)` gets base seed `seed + start * n`, the seed its first
prompt has in a single call, so a run's rollouts do not depend on how many replicas drew them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from grpo.inference.client import Completion, Endpoint, InferenceClient, ServerUnreachable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    """Prompts `[start, start + count)` of a call, sent to the replica at `url`."""

    url: str
    start: int
    count: int


def water_fill(outstanding: Sequence[int], count: int) -> list[int]:
    """How many of `count` new requests each replica gets so that the least loaded ones fill up first: request by
    request to the replica with the fewest outstanding (ties: the lower index)."""
    loads = list(outstanding)
    taken = [0] * len(loads)
    for _ in range(count):
        i = min(range(len(loads)), key=lambda j: (loads[j], j))
        loads[i] += 1
        taken[i] += 1
    return taken


class ReplicaLoad:
    """Per replica URL: generation requests in flight (`outstanding`) and sent so far (`sent`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outstanding: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        # Shares sent again to another replica because theirs stopped answering.
        self.failovers = 0

    def reserve(self, urls: Sequence[str], count: int) -> list[Share]:
        """Split `count` requests over `urls` by load, in contiguous shares in `urls` order; counts them as in
        flight (give each share back with `release`)."""
        with self._lock:
            taken = water_fill([self.outstanding.get(u, 0) for u in urls], count)
            shares, start = [], 0
            for url, k in zip(urls, taken):
                if k:
                    shares.append(Share(url, start, k))
                    self.outstanding[url] = self.outstanding.get(url, 0) + k
                    self.sent[url] = self.sent.get(url, 0) + k
                    start += k
            return shares

    def least_loaded(self, urls: Sequence[str], count: int) -> str:
        """The least loaded of `urls`, with `count` more requests counted on it (a failed-over share)."""
        with self._lock:
            url = min(urls, key=lambda u: self.outstanding.get(u, 0))
            self.outstanding[url] = self.outstanding.get(url, 0) + count
            self.sent[url] = self.sent.get(url, 0) + count
            self.failovers += 1
            return url

    def release(self, url: str, count: int) -> None:
        """`count` requests to `url` have ended (answered or failed)."""
        with self._lock:
            self.outstanding[url] = self.outstanding.get(url, 0) - count


class RoutedClient:
    """`generate` over the replicas at `urls`, by load (see the module docstring); one `InferenceClient` per replica,
    built with `client_kwargs`. Like an `InferenceClient`, one per thread."""

    def __init__(self, urls: Sequence[str], load: ReplicaLoad | None = None, **client_kwargs: Any) -> None:
        if not urls:
            raise ValueError("RoutedClient needs at least one server URL")
        self.urls = tuple(u.rstrip("/").removesuffix("/v1") for u in urls)
        self.load = load if load is not None else ReplicaLoad()
        self.clients = {url: InferenceClient(url, **client_kwargs) for url in self.urls}

    @property
    def base_url(self) -> str:
        """The replicas' URLs, for messages."""
        return ", ".join(self.urls)

    def generate(self, prompts: list[list[int]], n: int = 1, **sampling: Any) -> list[list[Completion]]:
        """`InferenceClient.generate` over the replicas: result[i] belongs to prompts[i]."""
        if not prompts:
            return []
        seed = sampling.pop("seed", None)
        shares = self.load.reserve(self.urls, len(prompts))

        def run(share: Share) -> list[list[Completion]]:
            return self._run_share(prompts, share, n, seed, sampling)

        if len(shares) == 1:
            return run(shares[0])
        with ThreadPoolExecutor(len(shares), thread_name_prefix="grpo-route") as pool:
            parts = list(pool.map(run, shares))
        return [group for part in parts for group in part]

    def _run_share(self, prompts: list[list[int]], share: Share, n: int, seed: int | None,
                   sampling: dict[str, Any]) -> list[list[Completion]]:
        """One share on its replica; when that one stops answering, on the least loaded replica not yet tried."""
        chunk = prompts[share.start:share.start + share.count]
        extra = {} if seed is None else {"seed": (int(seed) + share.start * n) % (2**63)}
        url, tried = share.url, {share.url}
        try:
            while True:
                try:
                    return self.clients[url].generate(chunk, n=n, **extra, **sampling)
                except ServerUnreachable as error:
                    rest = [u for u in self.urls if u not in tried]
                    if not rest:
                        raise
                    self.load.release(url, share.count)
                    failed, url = url, self.load.least_loaded(rest, share.count)
                    tried.add(url)
                    log.warning("replica %s stopped answering (%s); its %d prompts go to %s", failed, error,
                                share.count, url)
        finally:
            self.load.release(url, share.count)

    def close(self) -> None:
        """Close every replica's connection pool."""
        for client in self.clients.values():
            client.close()


def routed_client(endpoint: Endpoint, **client_kwargs: Any) -> RoutedClient:
    """A `RoutedClient` over `endpoint`'s replicas, sharing their load counts."""
    return RoutedClient(endpoint.urls, endpoint.load, **client_kwargs)

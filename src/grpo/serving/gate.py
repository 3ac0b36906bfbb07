"""The gate between generation and whatever takes a server away from it (a restarting weight sync)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator


class GenerationGate:
    """Lets a sync that takes the server away (a restart) wait for the generation in flight and keep new generation
    out meanwhile, so no request is sent to a server that is going down.

    The rollout side wraps each generation call in `generating()`; the sync side runs the restart inside `held()`.
    `held` first closes the gate (new `generating` calls wait), then waits until the calls in flight have ended:
    they always end, with an answer or the client's error after its retries, and the sync holds nothing they need,
    so neither side can wait on the other forever. Both may be entered from any thread; not re-entrant.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        # Seconds generation calls spent waiting at the closed gate (the generator's own view of the stall).
        self.waited_s = 0.0

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around one generation call: waits while a sync holds the gate."""
        with self._cond:
            t0 = time.monotonic()
            while self._closed:
                self._cond.wait()
            self.waited_s += time.monotonic() - t0
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def held(self) -> Iterator[float]:
        """Close the gate, wait for the calls in flight (drain); yields the seconds that took; reopens on exit."""
        with self._cond:
            self._closed = True
            t0 = time.monotonic()
            while self._active:
                self._cond.wait()
            drained = time.monotonic() - t0
        try:
            yield drained
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()

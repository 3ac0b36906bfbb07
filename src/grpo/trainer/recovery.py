"""The loop's answer to a server that died under a call (generation, an evaluation, a weight sync): the sync strategy
recovers (restarts the dead server, bounded by server.max_restarts; it raises when they are used up), then the call
runs once more."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def retried_after_recovery(call: Callable[[], T], recover: Callable[[BaseException], bool],
                           on_retry: Optional[Callable[[Exception], None]] = None) -> T:
    """`call()`; when it raises and `recover(error)` restarted the server, `on_retry(error)` and `call()` once more
    (whose error is raised as it is). An error `recover` does not take is raised as it is."""
    try:
        return call()
    except Exception as error:
        if not recover(error):
            raise
        if on_retry is not None:
            on_retry(error)
    return call()

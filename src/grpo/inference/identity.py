"""Which server is ours: a per-run token, the calls that need it, and a port nobody else can bind.

A run's launcher (`grpo.inference.process.VLLMServer`) starts its server with a fresh random token in the
environment (`GRPO_SERVER_TOKEN`, never on the command line, where `ps` would show it). The server's middleware then

- answers ``GET /health`` carrying the right token (header ``X-GRPO-Token``) with vLLM's own health answer plus the
  header ``X-GRPO-Token-Verified: true``, and with 403 when the token is another run's. A health answer without that
  header comes from something that is not a grpo server started by this run (another program, a plain
  ``python -m http.server``), and the launcher refuses it;
- refuses the weight-changing calls (`PROTECTED`) without the token (401) or with another run's (403), so a run can
  never reload, swap or pause another run's server by accident.

Everything else (``/generate``, ``/v1/*`` generation, plain ``/health`` without the header) stays open, so Atropos
environments need no token. A server started by hand without ``GRPO_SERVER_TOKEN`` checks nothing.

No port sharing: vLLM binds its socket with SO_REUSEADDR before the engine starts and listens only once the engine is
up (20-40 s later); in that window a second server (SO_REUSEADDR too) can bind the same port, and newer vLLM entry
points add SO_REUSEPORT. `exclusive_listen(port)`, called in the server process before vLLM runs, makes the bind of
that port listen at once and drops SO_REUSEPORT, so from the bind on the kernel refuses every other bind of it.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
from typing import Iterable, Mapping

# Environment variable the launcher sets in the server's environment.
TOKEN_ENV = "GRPO_SERVER_TOKEN"
# Request header carrying the token.
TOKEN_HEADER = "X-GRPO-Token"
# Response header of a /health answer whose token matched: the server's proof that it is the run's own.
VERIFIED_HEADER = "X-GRPO-Token-Verified"

# The handshake: GET VERSION_PATH answers {"server": SERVER_NAME, "protocol": PROTOCOL, ...} on a grpo server only,
# so a trainer told to attach to a URL can tell a grpo server from anything else that answers /health (a plain vLLM
# server has no /generate with weight versions and no /grpo/* endpoints). PROTOCOL counts incompatible changes of
# the /generate and /grpo/* endpoints.
VERSION_PATH = "/grpo/version"
SERVER_NAME = "grpo"
PROTOCOL = 1

# (method, path) of every call that changes what the server serves.
PROTECTED: frozenset[tuple[str, str]] = frozenset({
    ("POST", "/grpo/reload_weights"),
    ("POST", "/grpo/rpc"),
    ("POST", "/grpo/weight_transfer/init"),
    ("POST", "/grpo/weight_transfer/update"),
    ("POST", "/grpo/weight_version"),
    ("POST", "/grpo/pause"),
    ("POST", "/grpo/resume"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
})


def new_token() -> str:
    """A fresh random token for one run's server."""
    return secrets.token_hex(16)


def server_token() -> str | None:
    """The token this server process was started with (None: started by hand, no checks)."""
    return os.environ.get(TOKEN_ENV) or None


def header_value(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    """One header of an ASGI scope (case-insensitive), or None."""
    key = name.lower().encode()
    for k, v in headers:
        if k.lower() == key:
            return v.decode("latin-1")
    return None


def token_problem(expected: str | None, given: str | None) -> tuple[int, str] | None:
    """(HTTP status, reason) when `given` does not prove the caller is the run that owns this server; None if it does
    (or when the server has no token)."""
    if expected is None:
        return None
    if given is None:
        return 401, (f"missing {TOKEN_HEADER}: this server belongs to a run, and only that run may change its "
                     "weights or state")
    if not hmac.compare_digest(expected.encode(), given.encode()):
        return 403, f"wrong {TOKEN_HEADER}: this server was started by another run"
    return None


def exclusive_listen(port: int) -> None:
    """In the server process, before vLLM binds: the TCP socket bound to `port` listens right after its bind, and
    SO_REUSEPORT is never set, so no other process can bind that port while this server lives."""
    original_bind = socket.socket.bind
    original_setsockopt = socket.socket.setsockopt

    def setsockopt(self, level, optname, *args):
        # SO_REUSEPORT would let any later socket with the same option share the port (and its connections).
        if level == socket.SOL_SOCKET and optname == getattr(socket, "SO_REUSEPORT", None):
            return None
        return original_setsockopt(self, level, optname, *args)

    def bind(self, address):
        original_bind(self, address)
        if (
            self.type == socket.SOCK_STREAM
            and self.family in (socket.AF_INET, socket.AF_INET6)
            and isinstance(address, tuple)
            and int(address[1]) == port
        ):
            # Listening closes the bind-to-listen window: from here the kernel refuses other SO_REUSEADDR binds.
            # Connections queue in the backlog until uvicorn starts accepting.
            self.listen(2048)

    socket.socket.setsockopt = setsockopt
    socket.socket.bind = bind


def health_answer_owner(status: int, headers: Mapping[str, str], text: str) -> tuple[str, str]:
    """Who gave a GET /health answer sent with this run's token: ("ours", "") when it proves the token, ("down", why)
    for our server whose engine is not ready yet, ("foreign", what answered) otherwise."""
    if status == 200 and headers.get(VERIFIED_HEADER) == "true":
        return "ours", ""
    if status == 403:
        return "foreign", f"a grpo server of another run: {text[:200]}"
    if status == 200:
        return "foreign", f"/health answered 200 without proving this run's token (server: {headers.get('server')})"
    if status in (500, 502, 503) and headers.get(VERIFIED_HEADER) == "true":
        return "down", f"HTTP {status}"  # ours, engine not ready
    return "foreign", f"/health answered HTTP {status}"

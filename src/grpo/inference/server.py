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
  single-prompt answer per prompt (grpo.inference.generate; the versions: grpo.inference.served_version).
  ``priority`` (an integer, default 0) is vLLM's per-request scheduling priority (lower first; a server started with
  ``--scheduling-policy priority``, which the trainer's launcher passes by default): the held-out evaluation sends a
  larger one than the rollouts, so its requests yield to training's.
- ``GET|POST /grpo/weight_version``: the weight version served (rollouts carry it).
- ``POST /grpo/reload_weights``: reload full HF weights from a directory in place (vLLM's worker
  `reload_weights`, wrapped by our worker extension, through `collective_rpc`), reset the prefix cache, bump the version.
- ``POST /grpo/pause`` / ``POST /grpo/resume``: vLLM's pause / `resume_generation` ("keep": requests in flight
  freeze and go on after resume).
- ``POST /grpo/rpc``: call a `grpo_*` method of the worker extension (`WeightSyncExtension`) on every worker
  (these four: grpo.inference.sync_endpoints).
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
from typing import Any, Awaitable, Callable

from grpo.inference import identity, weight_transfer
from grpo.inference.generate import REQUEST_IDS, PromptFailed, describe, handle_generate
from grpo.inference.request_checks import (
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    MAX_SEQUENCES_ENV,
    BadRequest,
    model_limits,
)
from grpo.inference.served_version import app_state
from grpo.inference.sync_endpoints import (
    handle_pause,
    handle_reload_weights,
    handle_resume,
    handle_rpc,
    handle_weight_version,
)

log = logging.getLogger("vllm.grpo_server")
MIDDLEWARE = "grpo.inference.server.GRPOMiddleware"
# grpo-serve's own options (the rest are vLLM's): the bound on sequences (prompts x n) of one /generate request.
SEQUENCES_FLAG = "--max-sequences-per-request"
GRPO_FLAGS = frozenset({SEQUENCES_FLAG})
# Where grpo-serve listens unless --host says otherwise: this machine only.
DEFAULT_HOST = "127.0.0.1"
WORKER_EXTENSION = "grpo.inference.worker_extension.WeightSyncExtension"


async def handle_version(request) -> dict:
    """GET /grpo/version: the handshake (`identity.VERSION_PATH`): what this server is and the limits it applies."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("grpo")
    except PackageNotFoundError:
        package = None
    limits = await model_limits(app_state(request).engine_client)
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
                await app_state(Request(scope)).engine_client.abort(ids)
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

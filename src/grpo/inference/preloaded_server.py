"""The preloaded server process (grpo.inference.preload): imports what vLLM's API server imports, waits for the
launcher's command line, then runs the server as `python -m grpo.inference.server` would.

    python -m grpo.inference.preloaded_server      (started by grpo.inference.preload.start, never by hand)

Only the modules the API server imports are imported here, not the API server module itself: the server runs it as
`__main__` (grpo.inference.server.main), and a second copy already in `sys.modules` would split its module state.
On stdin comes one JSON line with the server's arguments, environment, log and working directory; an empty stdin
(the run launched no server, or ended) ends this process.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from grpo.inference.preload import PRELOADED_NOTE, SERVER_MODULE

API_SERVER = "vllm.entrypoints.openai.api_server"


def import_what_it_imports(module: str) -> None:
    """Import the modules that `module`'s top-level import statements name, without executing `module` itself."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"no module named {module!r}")
    package = module.rpartition(".")[0]
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            imported = importlib.import_module(base)
            for alias in node.names:
                if alias.name != "*" and not hasattr(imported, alias.name):
                    importlib.import_module(f"{base}.{alias.name}")  # a submodule named in `from x import y`


# When the imports began and ended (time.time()), said in the log against the launch's moment.
IMPORT_BEGAN = time.time()
try:
    import_what_it_imports(API_SERVER)
    server = importlib.import_module(SERVER_MODULE)
    IMPORT_ERROR: str | None = None
except Exception as error:  # noqa: BLE001 - the fresh server this process then becomes reports it in the log
    server = None
    IMPORT_ERROR = f"{type(error).__name__}: {error}"
IMPORT_ENDED = time.time()


def import_timing(sent_at: float) -> str:
    """How long the imports took and whether the launch (its message sent at `sent_at`) waited for them: what the
    preload saved is the import time before the launch."""
    lag = IMPORT_ENDED - sent_at
    when = f"{lag:.1f} s after the launch (which waited for it)" if lag > 0 else f"{-lag:.1f} s before the launch"
    return f"the imports took {IMPORT_ENDED - IMPORT_BEGAN:.1f} s and ended {when}"


def read_launch() -> dict[str, Any] | None:
    """The launcher's message, or None when stdin closed without one."""
    line = sys.stdin.readline().strip()
    return json.loads(line) if line else None


def write_to_log(log_path: str) -> None:
    """What this process printed so far (its imports' warnings, in the file its launcher gave it) into the server's
    log, then the log as its stdout and stderr, and /dev/null as its stdin, as a launched server has."""
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        earlier = os.pread(1, os.fstat(1).st_size, 0)
    except OSError:  # stdout is no regular file (started by hand): nothing to carry over
        earlier = b""
    os.write(log_fd, earlier)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def fresh_start_reason(env: dict[str, str]) -> str | None:
    """Why the imports done here cannot serve a server launched with `env`; None when they can."""
    if IMPORT_ERROR is not None:
        return f"the import failed ({IMPORT_ERROR})"
    torch = sys.modules.get("torch")
    if (torch is not None and torch.cuda.is_initialized()
            and env.get("CUDA_VISIBLE_DEVICES") != os.environ.get("CUDA_VISIBLE_DEVICES")):
        return "the import initialised CUDA before the server's CUDA_VISIBLE_DEVICES was set"
    return None


def main() -> None:
    launch = read_launch()
    if launch is None:
        return
    write_to_log(launch["log"])
    os.chdir(launch["cwd"])
    args, env = [str(a) for a in launch["args"]], {str(k): str(v) for k, v in launch["env"].items()}
    why = fresh_start_reason(env)
    if why is not None:
        print(f"grpo: the preloaded server process starts afresh: {why}", file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, "-m", SERVER_MODULE, *args], env)
    os.environ.clear()  # unsetenv/putenv: the engine processes vLLM starts inherit exactly the launch's environment
    os.environ.update(env)
    threads, torch = env.get("OMP_NUM_THREADS", ""), sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:  # OpenMP read it when torch loaded, unset then
        torch.set_num_threads(int(threads))
    print(f"{PRELOADED_NOTE}: {import_timing(float(launch['sent_at']))}", file=sys.stderr, flush=True)
    server.main(args)


if __name__ == "__main__":
    main()

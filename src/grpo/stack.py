"""One command for a local Atropos stack: run-api, the trainer (which launches its inference server) and the
built-in Atropos environment, stopped together on exit, Ctrl-C or SIGTERM.

    python -m grpo.stack [--task digits|gsm8k] [--api-port N] [--env-arg=--env.foo=bar ...] [train.py overrides...]

Start order matters with atroposlib 0.4.0: run-api first; then `train.py data=atropos`, which registers with
run-api before any data exists; the environment last, once the trainer's inference server answers /health (the
environment can only register after the trainer's first /batch anyway). Every child runs in its own process group;
the stack stops the environment, then the trainer (SIGTERM: it keeps its last complete checkpoint and stops its
server), then run-api, escalating to SIGKILL after a grace period. Logs of run-api and the environment go to
`--log-dir`; the trainer writes to this terminal and its own run dir.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import requests
from hydra import compose, initialize_config_dir

from grpo.conf import CONFIG_DIR
from grpo.config import register_configs
from grpo.recipes.initial_weights import resolve_model_dir
from grpo.stop import LAUNCHER_ENV

log = logging.getLogger("grpo.stack")

REPO = Path(__file__).resolve().parents[2]


class StackError(RuntimeError):
    """A component did not start or died early; the message names it and its log."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _find_train_py() -> Path:
    for candidate in (Path.cwd() / "train.py", REPO / "train.py"):
        if candidate.is_file():
            return candidate
    raise StackError("train.py not found in the current directory or the repository root")


def compose_train_config(overrides: list[str]):
    """The trainer's config for these overrides (to learn the server URL, model and batch shape)."""
    register_configs()
    # hydra.* overrides configure the trainer's own Hydra run; compose() does not need them.
    plain = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=plain)


class Child:
    """A subprocess in its own process group (session), stopped by signalling that group."""

    def __init__(self, name: str, cmd: list[str], log_path: Optional[Path], env: Optional[dict] = None) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        out = open(log_path, "ab") if log_path else None
        log.info("starting %s: %s", name, " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, env=env)
        if out:
            out.close()  # the child holds its own handle
        self.descendants: list = []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe(self) -> str:
        where = f"; log: {self.log_path}" if self.log_path else ""
        return f"{self.name} (pid {self.proc.pid}, exit code {self.proc.returncode}){where}"

    def remember_descendants(self) -> None:
        # Children that started their own session (the trainer's vLLM server) escape a killpg of this group.
        try:
            import psutil

            self.descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except Exception:  # psutil missing or the process already gone
            self.descendants = []

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> Optional[int]:
        """Signal the group, wait `grace_s`, then SIGKILL the group; then any remembered stray descendants."""
        if self.alive():
            self.remember_descendants()
            self._killpg(sig)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing its process group", self.name, grace_s)
                self._killpg(signal.SIGKILL)
                self.proc.wait()
        else:
            self._killpg(signal.SIGKILL)  # leftovers of a child that exited without stopping its group
        self._stop_strays(grace_s)
        return self.proc.returncode

    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _stop_strays(self, grace_s: float) -> None:
        strays = [p for p in self.descendants if p.is_running()]
        if not strays:
            return
        import psutil

        log.warning("%s left %d process(es) running; stopping them", self.name, len(strays))
        for p in strays:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, still = psutil.wait_procs(strays, timeout=grace_s)
        for p in still:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _wait_http(url: str, children: list[Child], timeout_s: float, what: str) -> None:
    """Wait until GET `url` answers 200 while every child in `children` is alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        for c in children:
            if not c.alive():
                raise StackError(f"{c.describe()} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} did not answer {url} within {timeout_s:.0f}s")
        time.sleep(0.5)


def _interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m grpo.stack",
        description="run-api + trainer (data=atropos, launches its vLLM server) + the built-in Atropos environment.",
        epilog="Unrecognised arguments are train.py overrides, e.g. train.steps=20 server.port=9101.",
    )
    p.add_argument("--task", choices=["digits", "gsm8k"], default="digits",
                   help="built-in environment task (gsm8k on a random tiny model scores 0 everywhere and atroposlib "
                        "skips all-equal groups: add --env-arg=--env.ensure_scores_are_not_same=false)")
    p.add_argument("--api-host", default="127.0.0.1", help="interface run-api binds")
    p.add_argument("--api-port", type=int, default=None, help="run-api port (default: a free one)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt in the environment")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="environment completion cap (default: 16 for digits, 256 for gsm8k)")
    p.add_argument("--env-arg", action="append", default=[],
                   help="extra environment CLI argument, e.g. --env-arg=--env.temperature=0.8 (repeatable)")
    p.add_argument("--log-dir", type=Path, default=None, help="logs of run-api and the environment")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for each component")
    p.add_argument("--grace", type=float, default=60.0, help="seconds each component gets to stop before SIGKILL")
    return p.parse_known_args(argv)


def _check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        if o.startswith("data=") and o != "data=atropos" or o.startswith("data.url="):
            raise SystemExit(f"grpo.stack sets data=atropos and data.url itself; remove {o!r}")
        if o.startswith("-"):
            raise SystemExit(f"unknown option {o!r} (train.py overrides look like key=value)")


def _plan(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """Where each process of the stack listens, the trainer's command-line overrides and its composed config."""
    _check_overrides(overrides)
    train_py = _find_train_py()
    api_port = args.api_port or _free_port()
    api_url = f"http://{'127.0.0.1' if args.api_host in ('0.0.0.0', '') else args.api_host}:{api_port}"
    overrides = [*overrides, "data=atropos", f"data.url={api_url}"]
    if not any(o.startswith(("experiment=", "~experiment", "+experiment=")) for o in overrides):
        # The default job's experiment (arith_quick) is a local arithmetic run; the stack's environment brings its
        # own task, so the trainer starts from the bare config (tiny Qwen2) unless an experiment is named.
        overrides.insert(0, "~experiment")
    cfg = compose_train_config(overrides)
    if not cfg.server.external_url and cfg.server.port is None:
        # The environment must know the server's port before the trainer starts it: fix a free one for both.
        overrides.append(f"server.port={_free_port()}")
        cfg = compose_train_config(overrides)
    if cfg.server.external_url:
        server_url = str(cfg.server.external_url).rstrip("/").removesuffix("/v1")
    else:
        host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "") else cfg.server.host
        server_url = f"http://{host}:{cfg.server.port}"
    batch = cfg.train.micro_batch_size * cfg.train.grad_accum
    if batch % args.group_size:
        raise SystemExit(f"--group-size {args.group_size} must divide the trainer's batch of {batch} sequences "
                         "(train.micro_batch_size x train.grad_accum): run-api packs whole groups")
    log_dir = args.log_dir or Path("outputs") / "stack" / time.strftime("%Y-%m-%d_%H-%M-%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    return {"argv": list(getattr(args, "argv", [])), "train_py": train_py, "api_port": api_port, "api_url": api_url,
            "server_url": server_url, "cfg": cfg, "overrides": overrides, "model_dir": resolve_model_dir(cfg.model),
            "log_dir": log_dir}


def _env_command(args: argparse.Namespace, plan: dict[str, Any]) -> list[str]:
    cfg, model_dir = plan["cfg"], plan["model_dir"]
    return [
        sys.executable, "-m", "grpo.tasks.atropos_env", "serve",
        f"--env.task={args.task}",
        f"--env.rollout_server_url={plan['api_url']}",
        f"--env.tokenizer_name={model_dir}",
        f"--env.group_size={args.group_size}",
        f"--env.max_token_length={cfg.model.max_seq_len}",
        f"--env.max_new_tokens={args.max_new_tokens or (16 if args.task == 'digits' else 256)}",
        f"--env.seed={cfg.train.seed}",
        # The stack, not the environment, decides when the run is over: left to itself the environment stops
        # once run-api's step plus its queue passes the run length, which can starve a trainer that drops
        # bad groups. Its off-policy limit (max_batches_offpolicy) still bounds the work queued ahead.
        "--env.total_steps=1000000000",
        f"--openai.base_url={plan['server_url']}/v1",
        f"--openai.tokenizer_name={model_dir}",
        *args.env_arg,
    ]


def _start(args: argparse.Namespace, plan: dict[str, Any], children: dict[str, Child]) -> None:
    """run-api, then the trainer (which starts the inference server), then the environment."""
    children["run-api"] = Child(
        "run-api",
        [sys.executable, "-m", "atroposlib.cli.run_api", "--host", args.api_host, "--port", str(plan["api_port"])],
        plan["log_dir"] / "run-api.log",
    )
    _wait_http(f"{plan['api_url']}/status", [children["run-api"]], args.startup_timeout, "run-api")
    # The trainer's stop block repeats the stack's command, not the trainer's (whose run-api URL dies with the stack).
    env = {**os.environ, LAUNCHER_ENV: shlex.join(["python", "-m", "grpo.stack", *plan["argv"]])}
    children["trainer"] = Child("trainer", [sys.executable, str(plan["train_py"]), *plan["overrides"]], None, env=env)
    _wait_http(f"{plan['server_url']}/health", list(children.values()), args.startup_timeout, "the inference server")
    children["env"] = Child("environment", _env_command(args, plan), plan["log_dir"] / "env.log")
    log.info("stack up: run-api %s, inference server %s; logs in %s", plan["api_url"], plan["server_url"],
             plan["log_dir"])


def _supervise(children: dict[str, Child]) -> int:
    """Wait for the trainer to finish; raise StackError when run-api or the environment dies first."""
    while True:
        if not children["trainer"].alive():
            code = children["trainer"].proc.returncode
            log.info("trainer finished with exit code %d", code)
            return code
        if not children["run-api"].alive():
            raise StackError(f"{children['run-api'].describe()} exited while the trainer was running")
        if not children["env"].alive() and children["env"].proc.returncode != 0:
            raise StackError(f"{children['env'].describe()} failed while the trainer was running")
        time.sleep(1.0)


def main(argv: Optional[list[str]] = None) -> int:
    """Start run-api, the trainer and an environment; stop all three when the trainer ends or on Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, overrides = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as the user gave it, for the stop block
    plan = _plan(args, overrides)
    children: dict[str, Child] = {}
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        _start(args, plan, children)
        code = _supervise(children)
    except KeyboardInterrupt:
        log.warning("interrupted; stopping the stack")
        code = 130
    except StackError as e:
        log.error("%s", e)
        code = 1
    finally:
        # Ignore further Ctrl-C while stopping: a half-stopped stack is worse than a slow stop.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        for name in ("env", "trainer", "run-api"):
            if name in children:
                rc = children[name].stop(signal.SIGTERM, args.grace)
                log.info("stopped %s (exit code %s)", children[name].name, rc)
        for s, h in old.items():
            signal.signal(s, h)
    return code


if __name__ == "__main__":
    sys.exit(main())

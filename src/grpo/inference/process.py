"""Process manager of one inference server (`python -m grpo.inference.server`).

The server runs in its own session / process group, so stopping it signals vLLM's API server, engine core and
worker processes together, and nothing else: no process is ever looked up by name.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import requests

from grpo.config_values import option
from grpo.inference import identity, preload, vllm_plugin
from grpo.inference.client import InferenceClient
from grpo.inference.launch_args import (
    TORCHRUN_VARS,
    compilation_args,
    gpus_per_server,
    pick_free_port,
    port_in_use,
    server_visible_devices,
)
from grpo.inference.server_log import log_tail, start_up_phase
from grpo.schema import ServerConfig

log = logging.getLogger(__name__)
# Seconds before the first "starting vLLM ..." progress line, and the most between two: the gap doubles from the
# first to the last, so a 3-minute GPU start-up (CUDA-graph capture) prints ~8 lines, not 40.
PROGRESS_FIRST_S = 5.0
PROGRESS_MAX_S = 30.0
# SIGTERM to SIGKILL for a server that never answered /health: vLLM ignores SIGTERM while it starts, so the usual
# grace (20 s) only made a Ctrl-C during start-up wait in silence; a server that never served has nothing to save.
STARTING_STOP_S = 2.0


class ServerStartError(RuntimeError):
    """The server could not start (bad arguments, port taken, crash or timeout during start-up)."""


class ServerCrashedError(RuntimeError):
    """The server process exited while it was expected to serve."""


class NotOurServerError(ServerStartError):
    """Something other than the server this launcher started answers on its host:port."""


class VLLMServer:
    """Launches, watches and stops one vLLM server with our /generate and /grpo/* endpoints.

    `server_cfg` is a `grpo.schema.ServerConfig` node (or any object/mapping with its fields: host, port,
    gpu_memory_utilization, kv_cache_gb, max_model_len, dtype, enforce_eager, max_lora_rank, startup_timeout_s, extra_args,
    device, busy_loop_s, worker_in_engine_process). `lora_modules` maps adapter names to adapter directories to
    preload; `enable_lora` turns LoRA on even with none preloaded (for hot-swapping). The server's output goes to
    `log_path` (appended across restarts, so a crash log survives the restart that follows it).

    `server_cfg.port` null picks a free port at the first start (kept across restarts). The server is started with
    a fresh run token (`.token`, `grpo.inference.identity`): start-up only accepts a /health answer that proves it,
    so another program or another run's server answering on host:port is an error, never adopted. Clients that
    change weights need the token: `.client()` or `InferenceClient(url, token=server.token)`.
    `served_model_name` may be a list: the first name is the one vLLM reports, the others are aliases it accepts.
    """

    def __init__(
        self,
        model: str | Path,
        server_cfg: Any,
        log_path: str | Path,
        lora_modules: Mapping[str, str | Path] | None = None,
        extra_args: Sequence[str] = (),
        enable_lora: bool | None = None,
        served_model_name: str | Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        weight_version: int = 0,
    ) -> None:
        self.model = str(model)
        self.cfg = server_cfg
        self.log_path = Path(log_path)
        self.lora_modules = {k: str(v) for k, v in (lora_modules or {}).items()}
        self.enable_lora = bool(self.lora_modules) if enable_lora is None else enable_lora
        self.extra_args = list(extra_args)
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        # Duplicates would make vLLM list one model twice.
        self.served_model_names = list(dict.fromkeys(str(n) for n in names if n))
        self.env = dict(env or {})
        # Passed to the server at start so /generate reports it (versions survive restarts).
        self.weight_version = weight_version
        self.host: str = option(server_cfg, "host", ServerConfig.host)
        port = option(server_cfg, "port", None)
        # None until the first start picks a free one (server.port: null).
        self.port: int | None = int(port) if port is not None else None
        # Proves to the launcher that the server answering is this one; sent on every weight-changing call.
        self.token = identity.new_token()
        self.proc: subprocess.Popen | None = None
        # Whether the current process has answered /health (a server still starting is stopped without grace).
        self.ready = False
        # time.monotonic() when this server's process was last launched: its start-up clock (`wait_healthy`).
        self.started_at: float | None = None
        self._log_file = None
        self.restarts = 0

    # ------------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """http://host:port (no /v1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def served_model_name(self) -> str | None:
        """The name vLLM reports for the base model (the first of `served_model_names`)."""
        return self.served_model_names[0] if self.served_model_names else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def pid_path(self) -> Path:
        """`vllm.pid` beside the log: the running server's pid (its process group id); removed by stop()."""
        return self.log_path.with_name(self.log_path.stem + ".pid")

    def command(self) -> list[str]:
        """The full command line of the server."""
        c = self.cfg
        args = [
            sys.executable, "-m", "grpo.inference.server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--gpu-memory-utilization", str(option(c, "gpu_memory_utilization", ServerConfig.gpu_memory_utilization)),
            "--max-model-len", str(option(c, "max_model_len", ServerConfig.max_model_len)),
            "--dtype", str(option(c, "dtype", ServerConfig.dtype)),
            # Atropos clients post many requests at once; uvicorn's access log costs time and log space.
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        sequences = option(c, "max_sequences_per_request")
        if sequences is not None:
            args += ["--max-sequences-per-request", str(int(sequences))]
        if self.served_model_names:
            args += ["--served-model-name", *self.served_model_names]
        kv_cache_gb = option(c, "kv_cache_gb", None)
        if kv_cache_gb is not None:
            args += ["--kv-cache-memory-bytes", str(int(float(kv_cache_gb) * 2**30))]
        quantization = option(c, "quantization", None)
        if quantization is not None:
            args += ["--quantization", str(quantization)]
        if option(c, "enforce_eager") is True:
            args.append("--enforce-eager")
        args += compilation_args(c, self.all_extra_args)
        chunked_prefill = option(c, "chunked_prefill")
        if chunked_prefill is not None:
            args.append("--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill")
        if option(c, "scheduling_policy") is not None:  # priority: eval requests (eval.priority) yield to rollouts'
            args += ["--scheduling-policy", str(option(c, "scheduling_policy"))]
        if self.enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(option(c, "max_lora_rank", ServerConfig.max_lora_rank))]
            if self.lora_modules:
                args += ["--lora-modules", *[f"{k}={v}" for k, v in self.lora_modules.items()]]
        if self.worker_in_engine_process:
            args += ["--distributed-executor-backend", "uni"]
        return args + self.all_extra_args

    @property
    def all_extra_args(self) -> list[str]:
        """server.extra_args, then the launcher's own (the sync mode's flags)."""
        return [str(a) for a in option(self.cfg, "extra_args", None) or []] + [str(a) for a in self.extra_args]

    @property
    def worker_in_engine_process(self) -> bool:
        """server.worker_in_engine_process: vLLM's one model worker runs inside its engine-core process."""
        return bool(option(self.cfg, "worker_in_engine_process", ServerConfig.worker_in_engine_process))

    def environment(self) -> dict[str, str]:
        # Under torchrun the trainer's rank variables would otherwise leak into vLLM, which is not a member of the
        # trainer's process group and runs its own torch.distributed setup.
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
        device = option(self.cfg, "device")
        if device is not None:
            # A tensor-parallel server takes server.device and the GPUs after it.
            env["CUDA_VISIBLE_DEVICES"] = server_visible_devices(
                int(device), gpus_per_server(self.all_extra_args), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if self.enable_lora:
            # Lets /v1/load_lora_adapter and /v1/unload_lora_adapter work (lora_only hot-swap).
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        # How vLLM starts its engine core (and workers): spawn unless server.engine_start_method or the environment
        # says otherwise. A forked child of a process that already ran torch on the CPU can hang (REFERENCE.md); the
        # API server runs none before it starts the engine, and vLLM spawns anyway once that process touched CUDA.
        method = option(self.cfg, "engine_start_method")
        if method is not None:
            env["VLLM_WORKER_MULTIPROC_METHOD"] = str(method)
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if self.worker_in_engine_process:
            # vLLM's CPU platform replaces the `uni` executor with a worker process unless this is 0. The API
            # server still runs its engine core in a process of its own (AsyncLLM always does).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # vLLM's worker process binds its OpenMP threads to all cores but one; inside the engine core nothing
            # does, and two unbound thread pools (the server's and the trainer's) spin-waiting on the same cores made
            # async rollouts 4x slower. The same count as vLLM's own layout, unless the caller chose one.
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))
        env["GRPO_WEIGHT_VERSION"] = str(self.weight_version)
        env[identity.TOKEN_ENV] = self.token
        # Read by grpo.inference.vllm_plugin in each vLLM process; unset keeps vLLM's own busy-loop.
        env.pop(vllm_plugin.ENV, None)
        env.pop(vllm_plugin.PLAIN_GEMM_ENV, None)  # only a strategy that trains vLLM's memory asks for it (self.env)
        busy_loop_s = option(self.cfg, "busy_loop_s")
        if busy_loop_s is not None:
            env[vllm_plugin.ENV] = str(float(busy_loop_s))
        env.update(self.env)
        # A VLLM_PLUGINS allow-list would otherwise leave the plugin, and so what it was asked to do, out.
        asked = env.get(vllm_plugin.ENV) or env.get(vllm_plugin.PLAIN_GEMM_ENV)
        if asked and env.get("VLLM_PLUGINS") and vllm_plugin.PLUGIN_NAME not in env["VLLM_PLUGINS"].split(","):
            env["VLLM_PLUGINS"] += "," + vllm_plugin.PLUGIN_NAME
        return env

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None, wait: bool = True) -> None:
        """Launch and wait until /health answers; ServerStartError (with the log tail) otherwise. `wait=False` returns
        once the process runs (several servers start side by side; `wait_started` each). Call it from a thread that
        lives as long as the server: the server gets SIGTERM when the thread that started it ends."""
        if self.running():
            raise ServerStartError(f"server already running (pid {self.pid})")
        if not Path(self.model).exists():
            raise ServerStartError(f"model path {self.model} does not exist")
        for name, path in self.lora_modules.items():
            if not Path(path).exists():
                raise ServerStartError(f"LoRA adapter {name!r}: {path} does not exist")
        if self.port is None:
            self.port = pick_free_port(self.host)
        if port_in_use(self.host, self.port):
            raise ServerStartError(
                f"port {self.port} on {self.host} is already in use; stop what listens there or pick another "
                f"server.port (null picks a free one)"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"\n===== grpo: starting {' '.join(self.command())}\n".encode())
        self._log_file.flush()
        self.ready = False
        # Through the command's preloaded process when it can (grpo.inference.preload), else a new process in its
        # own session (= process group: stop() signals exactly the server and its children).
        self.proc, imports_began = preload.launch(self.command(), self.environment(), self.log_path, self._log_file)
        # Replicas start side by side and are waited for one after another: each one's clock and line start here,
        # with its process, so "ready after N s" is true of each (it read 0 s for a second replica).
        self.started_at = time.monotonic()
        early = "" if imports_began is None else (
            f"; its imports began {self.started_at - imports_began:.0f} s earlier, in a preloaded process")
        log.info("starting vLLM on %s:%s (log: %s%s)", self.host, self.port, self.log_path, early)
        # The pid (= process group id) of the running server, for operators and fault tests.
        self.pid_path.write_text(f"{self.proc.pid}\n")
        if wait:
            self.wait_started(timeout)

    def wait_started(self, timeout: float | None = None) -> None:
        """`wait_healthy` for `timeout` seconds, by default server.startup_timeout_s."""
        if timeout is None:
            timeout = float(option(self.cfg, "startup_timeout_s", ServerConfig.startup_timeout_s))
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health until this server answers it with the run token's proof, at most `timeout` s from its
        process's launch; fail fast if the process exits or something else answers on host:port. Logs progress (with
        what vLLM's log says it is doing) at growing gaps, timed from the launch."""
        t0 = self.started_at if self.started_at is not None else time.monotonic()
        gap = PROGRESS_FIRST_S
        deadline, next_report = t0 + timeout, max(t0 + gap, time.monotonic())
        while time.monotonic() < deadline:
            proc = self.proc  # once: a stop() on another thread may clear it
            if proc is not None and proc.poll() is not None:
                code = proc.returncode
                self._cleanup_group()
                raise self._start_failed(f"inference server exited with code {code} during start-up")
            state, detail = self.probe(timeout=2.0)
            if state == "ours":
                self.ready = True
                log.info("vLLM ready at %s after %.0f s", self.url, time.monotonic() - t0)
                return
            if state == "foreign":
                self.stop()
                raise NotOurServerError(
                    f"something else answers on {self.host}:{self.port} ({detail}); it is not the server this run "
                    f"started, so the run will not use it. Stop it or pick another server.port (null picks a free "
                    f"one). Our server's log: {self.log_path}"
                )
            if time.monotonic() >= next_report:
                log.info("starting vLLM: %.0f s%s", time.monotonic() - t0, self.start_up_phase())
                gap = min(2 * gap, PROGRESS_MAX_S)
                next_report = max(next_report + gap, time.monotonic() + PROGRESS_FIRST_S)
            time.sleep(0.25)
        self.stop()
        raise self._start_failed(f"inference server not healthy after {timeout:.0f}s")

    def _start_failed(self, what: str) -> ServerStartError:
        """The error for a failed start-up, with the log's last lines (also logged, for runs that only log)."""
        tail = self.log_tail(40)
        if "Address already in use" in tail:  # the whole story: vLLM's bind traceback in the tail adds nothing
            what += (f": port {self.port} on {self.host} was taken by another process while this server started; "
                     f"pick another server.port (null picks a free one); log {self.log_path}")
            log.error(what)
            return ServerStartError(what)
        log.error("%s; last lines of %s:\n%s", what, self.log_path, tail)
        return ServerStartError(f"{what}; log {self.log_path}:\n{tail}")

    def running(self) -> bool:
        """True while the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def probe(self, timeout: float = 5.0) -> tuple[str, str]:
        """Who answers GET /health on host:port: ("ours", "") when it proves the run token, ("down", why) when
        nothing answers yet, ("foreign", what answered) otherwise."""
        if self.port is None:
            return "down", "not started"
        try:
            r = requests.get(self.url + "/health", headers={identity.TOKEN_HEADER: self.token}, timeout=timeout)
        except requests.RequestException as e:
            return "down", type(e).__name__
        return identity.health_answer_owner(r.status_code, r.headers, r.text)

    def healthy(self, timeout: float = 5.0) -> bool:
        """True when the process is alive and GET /health answers 200 with the run token's proof."""
        if not self.running():
            return False
        return self.probe(timeout)[0] == "ours"

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) the server's API process has used so far; None when it is gone or stopped
        (SIGSTOP: a hang, however busy it was) or /proc cannot tell (not Linux)."""
        proc = self.proc
        if proc is None:
            return None
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
        except OSError:
            return None
        # Fields after the command name (which may hold spaces): state is the 3rd field, utime and stime the 14th/15th.
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("T", "t", "Z", "X"):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def busy(self, timeout: float, min_share: float = 0.05) -> bool:
        """True when the process runs (not stopped) and used at least `min_share` of a core while its /health was asked
        for `timeout` seconds without an answer: busy (a large answer being built), not hung. False when /health
        answered, or the process is dead, stopped or idle (a deadlock)."""
        before, t0 = self.cpu_seconds(), time.monotonic()
        if before is None or self.probe(timeout)[0] == "ours":
            return False
        after = self.cpu_seconds()
        return after is not None and after - before >= min_share * (time.monotonic() - t0)

    def client(self, **kwargs: Any):
        """An InferenceClient of this server that carries the run token (needed for weight-changing calls)."""
        return InferenceClient(self.url, token=self.token, **kwargs)

    def check(self) -> None:
        """Raise ServerCrashedError with the log tail if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerCrashedError(
                f"inference server (pid {self.proc.pid}) exited with code {self.proc.returncode}; "
                f"log {self.log_path}:\n{self.log_tail(40)}"
            )

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout` s (STARTING_STOP_S for a server that has
        not answered /health yet). Safe to call twice."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                grace = self.stop_grace(timeout)
                self._signal_group(signal.SIGTERM)
                self._signal_group(signal.SIGCONT)  # a stopped (hung) server handles SIGTERM only once continued
                try:
                    proc.wait(timeout=min(grace, 1.0))
                except subprocess.TimeoutExpired:
                    self._wait_or_kill(proc, grace)
            self._cleanup_group()
            try:
                self.pid_path.unlink(missing_ok=True)
            except OSError as e:  # a run dir turned read-only: the server is stopped all the same
                log.warning("vLLM stopped, but its pid file %s could not be removed: %s", self.pid_path, e)
        self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop_grace(self, timeout: float) -> float:
        """Seconds `stop(timeout)` waits between SIGTERM and SIGKILL: `timeout`, or at most STARTING_STOP_S while
        the server has not answered /health yet (vLLM ignores SIGTERM while it starts)."""
        return timeout if self.ready else min(timeout, STARTING_STOP_S)

    def _wait_or_kill(self, proc: subprocess.Popen, grace: float) -> None:
        # Said on the terminal: a stop that waits in silence (a Ctrl-C during a long step) looks like a hang.
        log.info("stopping vLLM (pid %d): waiting up to %.0f s for it to exit, then SIGKILL", proc.pid, grace)
        try:
            proc.wait(timeout=max(grace - 1.0, 0.0))
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(
        self,
        model: str | Path | None = None,
        lora_modules: Mapping[str, str | Path] | None = None,
        weight_version: int | None = None,
        wait: bool = True,
    ) -> None:
        """Stop, optionally switch weights / preloaded adapters / version, start again (`wait`: as in `start`)."""
        self.stop()
        if model is not None:
            self.model = str(model)
        if lora_modules is not None:
            self.lora_modules = {k: str(v) for k, v in lora_modules.items()}
            self.enable_lora = self.enable_lora or bool(self.lora_modules)
        if weight_version is not None:
            self.weight_version = weight_version
        self.restarts += 1
        # Same port as before (Atropos environments know it). The old socket can linger for a moment after the process dies.
        deadline = time.monotonic() + 10
        while port_in_use(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.start(wait=wait)

    def move_records(self, log_path: str | Path) -> None:
        """A running server taken over by another run dir (a sweep's next job): from now on its log is read, and a
        restart appends, through `log_path`, a link to the file the process writes, and its pid file lies beside it
        (where fault tests and `grpo-stop` look); the earlier pid file goes."""
        log_path = Path(log_path)
        if log_path != self.log_path:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.unlink(missing_ok=True)
            log_path.symlink_to(self.log_path.resolve())
            self.pid_path.unlink(missing_ok=True)
            self.log_path = log_path
        if self.proc is not None:
            self.pid_path.write_text(f"{self.proc.pid}\n")
        if self._log_file is not None:
            self._log_file.write(f"\n===== grpo: now serving the run dir {log_path.parent.parent}\n".encode())
            self._log_file.flush()

    def start_up_phase(self) -> str:
        """` (<vLLM's last log message>)`, shortened, or "" when the log has none yet: what a start-up is busy with."""
        return start_up_phase(self.log_path)

    def log_tail(self, n: int = 40) -> str:
        """Last `n` lines of the server log."""
        return log_tail(self.log_path, n)

    # ------------------------------------------------------------------ internals
    def _signal_group(self, sig: int) -> bool:
        """Signal the server's process group (pgid == pid: it leads its own session); False when it is gone.
        Reads `self.proc` once: a stop() on another thread may clear it meanwhile."""
        proc = self.proc
        if proc is None:
            return False
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def _cleanup_group(self) -> None:
        # vLLM's children (engine core, workers) may outlive the API server if it died hard: kill the group.
        if not self._signal_group(0):
            return
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not self._signal_group(0):
                return
            time.sleep(0.1)
        self._signal_group(signal.SIGKILL)

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leave a server behind
        try:
            if self.proc is not None and self.proc.poll() is None:
                self._signal_group(signal.SIGKILL)
        except Exception:
            pass

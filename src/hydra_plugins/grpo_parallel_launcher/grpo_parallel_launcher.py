"""`hydra/launcher=grpo_parallel hydra.launcher.jobs_at_once=N`: a sweep's jobs N at once on one host.

The launcher starts N worker processes (spawned, each in a session of its own) that take the sweep's jobs from one
queue, one job at a time each, so a job waits until a worker is free. Each worker runs its jobs one after another
the way Hydra's basic launcher does, so it keeps its vLLM server between them (server.reuse_across_jobs,
grpo.serving.kept): one server per worker. On a GPU host each worker gets a GPU group of its own through
CUDA_VISIBLE_DEVICES, as many GPUs as the sweep's largest job layout needs (the trainer's GPU and the GPUs its
server.device / server.devices and tensor-parallel size name: 1 for shared_vllm or a server beside the trainer, 2
for broadcast); `hydra.launcher.gpus_per_job` sets it. A job whose worker dies is recorded as failed and a new
worker takes the next job; Ctrl-C (or SIGTERM) stops every running job the way Ctrl-C stops a run (its last complete
checkpoint kept, resumable with train.resume) and starts no other.
"""

# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where a dataclass with
# string annotations cannot resolve them.
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

# Seconds the launcher waits for the workers to stop their jobs after Ctrl-C before it kills them.
STOP_GRACE_S = 120.0


@dataclass
class GrpoParallelLauncherConf:
    _target_: str = "hydra_plugins.grpo_parallel_launcher.grpo_parallel_launcher.GrpoParallelLauncher"
    # Jobs that run at once (worker processes, each running its share of the sweep's jobs one after another).
    jobs_at_once: int = 2
    # GPUs each worker gets (CUDA_VISIBLE_DEVICES); null = what the sweep's largest job layout needs. Ignored where
    # no GPU is visible (the jobs then share the host's CPUs).
    gpus_per_job: Optional[int] = None
    # The GPU ids to place jobs on; null = those of CUDA_VISIBLE_DEVICES, else every GPU of the host.
    gpus: Optional[List[int]] = None


ConfigStore.instance().store(group="hydra/launcher", name="grpo_parallel", node=GrpoParallelLauncherConf,
                             provider="grpo")


def layout_gpus(cfg: DictConfig) -> int:
    """GPUs one job's layout takes: the trainer's (index 0) and those of its launched servers (server.device or
    server.devices, each with its tensor x pipeline x data parallel size)."""
    from grpo.inference.process import gpus_per_server

    server = cfg.server
    if server.get("external_url") or server.get("external_urls"):
        return 1
    firsts = [int(d) for d in (server.get("devices") or [])] or (
        [int(server.device)] if server.get("device") is not None else [])
    per_server = gpus_per_server(server.get("extra_args"))
    return max([1, per_server] + [first + per_server for first in firsts])


def visible_gpus(given: Optional[Sequence[int]]) -> list[str]:
    """The GPU ids the launcher may hand out: `given`, else CUDA_VISIBLE_DEVICES, else every GPU torch sees."""
    if given:
        return [str(g) for g in given]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def plan_slots(jobs_at_once: int, need: int, gpus: list[str]) -> list[Optional[str]]:
    """Each worker's CUDA_VISIBLE_DEVICES (None: no GPU to place, the worker inherits the environment)."""
    if jobs_at_once < 1:
        raise ValueError(f"hydra.launcher.jobs_at_once must be >= 1, got {jobs_at_once}")
    if not gpus:
        return [None] * jobs_at_once
    slots = min(jobs_at_once, len(gpus) // need)
    if slots == 0:
        raise ValueError(f"each job of this sweep needs {need} GPU(s) (its layout, or hydra.launcher.gpus_per_job) "
                         f"and {len(gpus)} are visible ({','.join(gpus)}); lower the layout's GPUs or give more")
    return [",".join(gpus[i * need:(i + 1) * need]) for i in range(slots)]


def _raise_interrupt(signum: int, frame: Any) -> None:  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def task_function_of(module: str, name: str) -> TaskFunction:
    """The app's task function, found again in a worker: the function `@hydra.main` wrapped."""
    function = getattr(importlib.import_module(module), name)
    return getattr(function, "__wrapped__", function)


def portable(ret: JobReturn) -> JobReturn:
    """`ret` with an exception that may not pickle replaced by a RuntimeError saying it."""
    if ret.status == JobStatus.FAILED:
        try:
            pickle.dumps(ret.return_value)
        except Exception:  # noqa: BLE001 - whatever failed to pickle, its message still travels
            ret.return_value = RuntimeError(repr(ret.return_value))
    return ret


def worker(slot: int, jobs: Any, results: Any, payload: bytes) -> None:
    """A worker process: run jobs from `jobs` one after another until it gets None; report each to `results`."""
    os.setsid()  # the launcher alone forwards a Ctrl-C, once, to each worker
    _die_with_parent()
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a job installs its own handler; between jobs, this one
    signal.signal(signal.SIGINT, _raise_interrupt)
    from hydra._internal.callbacks import Callbacks

    from grpo.serving import kept

    instances, module, name = pickle.loads(payload)
    setup_globals()
    task_function = task_function_of(module, name)  # its import registers the app's own resolvers
    # Hydra's singletons (the config store, the job runtime) as the launcher has them; the resolvers this process
    # registered itself (they do not pickle).
    Singleton.set_state({**Singleton.get_state(), "instances": instances})
    context: Optional[HydraContext] = None
    try:
        while (item := jobs.get()) is not None:
            idx, sweep_config = item
            results.put(("started", idx, slot))
            context = context or HydraContext(config_loader=None, callbacks=Callbacks(sweep_config))
            ret = run_job(hydra_context=context, task_function=task_function, config=sweep_config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            results.put(("done", idx, portable(ret)))
    except KeyboardInterrupt:
        pass
    finally:
        kept.stop_kept()  # the worker's last job kept its server


class GrpoParallelLauncher(Launcher):
    """Runs a sweep's jobs `jobs_at_once` at a time in worker processes; see the module docstring."""

    def __init__(self, jobs_at_once: int = 2, gpus_per_job: Optional[int] = None,
                 gpus: Optional[List[int]] = None) -> None:
        super().__init__()
        self.jobs_at_once = int(jobs_at_once)
        self.gpus_per_job = gpus_per_job
        self.gpus = list(gpus) if gpus else None
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        configs = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            configs.append((idx, sweep_config))
        need = self.gpus_per_job or max(layout_gpus(c) for _, c in configs)
        slots = plan_slots(min(self.jobs_at_once, len(configs)), need, visible_gpus(self.gpus))
        log.info("Launching %d jobs, %d at once%s", len(configs), len(slots),
                 "" if slots[0] is None else f" (GPUs per job: {need}; groups: {' | '.join(slots)})")
        for idx, cfg in configs:
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(cfg.hydra.overrides.task)))
        return Sweep(self, configs, slots).run()


class Sweep:
    """One launch: its workers, the jobs' queue and what came back."""

    def __init__(self, launcher: GrpoParallelLauncher, configs: list[tuple[int, DictConfig]],
                 slots: list[Optional[str]]) -> None:
        self.configs = dict(configs)
        self.slots = slots
        self.ctx = mp.get_context("spawn")
        self.jobs, self.results = self.ctx.Queue(), self.ctx.Queue()
        fn = launcher.task_function
        self.payload = pickle.dumps((Singleton.get_state()["instances"], fn.__module__, fn.__name__))
        self.workers: dict[int, Any] = {}
        self.running: dict[int, int] = {}  # slot -> job idx
        self.returns: dict[int, JobReturn] = {}
        self.t0 = time.monotonic()

    def start_worker(self, slot: int) -> None:
        env = os.environ.copy()
        if self.slots[slot] is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.slots[slot]
        try:  # a spawned process inherits the environment as it is when it starts
            process = self.ctx.Process(target=worker, args=(slot, self.jobs, self.results, self.payload),
                                       name=f"grpo-sweep-worker{slot}")
            process.start()
        finally:
            os.environ.clear()
            os.environ.update(env)
        self.workers[slot] = process

    def run(self) -> list[JobReturn]:
        for item in self.configs.items():
            self.jobs.put(item)
        for slot in range(len(self.slots)):
            self.jobs.put(None)  # one end mark per worker; a worker that dies mid-job leaves its own for the next
            self.start_worker(slot)
        try:
            while len(self.returns) < len(self.configs):
                self.collect()
        except KeyboardInterrupt:
            self.stop()
            raise SystemExit(130) from None
        for process in self.workers.values():
            process.join(timeout=60)
        log.info("sweep wall clock %.0f s for %d jobs", time.monotonic() - self.t0, len(self.configs))
        return [self.returns[idx] for idx in sorted(self.returns)]

    def collect(self) -> None:
        """Take one message from the workers, or notice a worker that died in a job."""
        try:
            message = self.results.get(timeout=1.0)
        except queue.Empty:
            self.replace_dead_workers()
            return
        if message[0] == "started":
            _, idx, slot = message
            self.running[slot] = idx
            return
        _, idx, ret = message
        self.running = {s: i for s, i in self.running.items() if i != idx}
        self.returns[idx] = ret

    def replace_dead_workers(self) -> None:
        for slot, process in list(self.workers.items()):
            if process.is_alive() or slot not in self.running:
                continue
            idx = self.running.pop(slot)
            log.error("job #%d: its worker (pid %d) exited with code %s; recorded as failed, the sweep goes on", idx,
                      process.pid, process.exitcode)
            self.returns[idx] = self.failed(idx, RuntimeError(f"the worker running job #{idx} exited with code "
                                                              f"{process.exitcode}"))
            if len(self.returns) < len(self.configs):
                self.start_worker(slot)

    def failed(self, idx: int, error: BaseException) -> JobReturn:
        cfg = self.configs[idx]
        ret = JobReturn(overrides=list(cfg.hydra.overrides.task), hydra_cfg=cfg, return_value=error,
                        status=JobStatus.FAILED)
        return ret

    def stop(self) -> None:
        """Ctrl-C: every worker stops its job the way Ctrl-C stops a run; those that do not within STOP_GRACE_S are
        killed with their process group."""
        log.warning("stopping the sweep: %d running job(s) stop and keep their last checkpoint; no other starts",
                    len(self.running))
        for process in self.workers.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.workers.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                os.killpg(process.pid, signal.SIGKILL)
                process.join(timeout=10)
        self.jobs.cancel_join_thread()
        self.results.cancel_join_thread()


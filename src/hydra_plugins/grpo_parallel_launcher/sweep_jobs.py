"""The processes of a `hydra/launcher=grpo_parallel` sweep: its worker processes, each bound to a GPU group, and the
loop that hands them the sweep's jobs as GPUs come free (see grpo_parallel_launcher.py)."""

# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules.
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from hydra_plugins.grpo_parallel_launcher.placement import check_fits, group_ids, place

log = logging.getLogger(__name__)

# Seconds the launcher waits for the workers to stop their jobs after Ctrl-C before it kills them.
STOP_GRACE_S = 120.0
# Seconds a retired idle worker gets to stop its kept server and exit.
RETIRE_S = 60.0



def _raise_interrupt(signum: int, frame: Any) -> None:  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_threads(jobs_at_once: int, cores: Optional[int] = None) -> int:
    """The CPU threads each of `jobs_at_once` workers is given (OMP_NUM_THREADS, unless the environment sets it): the
    host's cores shared out, as torchrun shares them among its ranks. Each trainer's torch would otherwise size its
    thread pool to every core, and N of them oversubscribe the cores that their vLLM engines and reward workers need."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // jobs_at_once)


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
    """A worker process: run the jobs it is sent one after another until it gets None; report each to `results`."""
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
            context = context or HydraContext(config_loader=None, callbacks=Callbacks(sweep_config))
            ret = run_job(hydra_context=context, task_function=task_function, config=sweep_config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            results.put(("done", idx, slot, portable(ret)))
    except KeyboardInterrupt:
        pass
    finally:
        kept.stop_kept()  # the worker's last job kept its server


@dataclass
class Worker:
    """A worker process, the GPU group it is bound to (None: no GPU) and the job it runs (None: idle)."""

    process: Any
    jobs: Any  # its own queue of jobs
    gpus: Optional[str]
    shared_lora: bool
    job: Optional[int] = None


class Sweep:
    """One launch: its workers, its jobs in sweep order, what came back, and the shared LoRA server if any."""

    def __init__(self, launcher: Any, configs: Dict[int, DictConfig], needs: Dict[int, int], gpus: List[str],
                 lora: Any = None) -> None:
        self.configs, self.needs, self.gpus, self.lora = configs, needs, gpus, lora
        self.jobs_at_once = launcher.jobs_at_once
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        fn = launcher.task_function
        self.payload = pickle.dumps((Singleton.get_state()["instances"], fn.__module__, fn.__name__))
        self.workers: Dict[int, Worker] = {}
        self.next_slot = 0
        self.pending: Deque[int] = deque(sorted(configs))
        self.returns: Dict[int, JobReturn] = {}
        # The sharing jobs' GPU group (they run beside their server), taken from the host's GPUs for the sweep.
        self.lora_gpus: Optional[str] = None
        self.free = list(gpus)
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------ the run
    def run(self) -> List[JobReturn]:
        completed = False
        try:
            if self.lora is not None:
                self.start_lora_server()
            while self.pending or self.running():
                self.dispatch()
                self.collect()
            completed = True
        except KeyboardInterrupt:
            self.stop()
            raise SystemExit(130) from None
        finally:
            for w in list(self.workers.values()):
                self.retire(w)
            if self.lora is not None:
                self.lora.stop(keep=completed)
            self.results.cancel_join_thread()
        log.info("sweep wall clock %.0f s for %d jobs", time.monotonic() - self.t0, len(self.configs))
        return [self.returns[idx] for idx in sorted(self.returns)]

    def start_lora_server(self) -> None:
        if self.gpus:
            need = max(self.needs[idx] for idx in self.lora.jobs)
            self.lora_gpus = ",".join(self.free[:need])
            self.free = self.free[need:]
            # The server's GPUs are the sweep's: the other jobs must fit in the rest.
            check_fits([(i, n) for i, n in self.needs.items() if i not in self.lora.jobs], self.free)
        from grpo.inference.process import ServerStartError

        try:
            self.lora.start(self.lora_gpus)
        except ServerStartError as error:  # the LoRA jobs fail with it (NaN objectives); the others still run
            log.error("the shared LoRA server did not start (%s); its %d job(s) are recorded as failed, the sweep "
                      "goes on", error, len(self.lora.jobs))
            for idx in self.lora.jobs:
                self.returns[idx] = self.failed(idx)
            self.pending = deque(i for i in self.pending if i not in self.lora.jobs)
            self.lora = None
            self.release(Worker(None, None, self.lora_gpus, False))  # its GPUs go to the other jobs
            return
        for idx in self.lora.jobs:
            self.lora.job_config(idx, self.configs[idx])

    def running(self) -> List[Worker]:
        return [w for w in self.workers.values() if w.job is not None]

    def dispatch(self) -> None:
        """Start the jobs at the head of the queue that can start now, in sweep order."""
        while self.pending and len(self.running()) < self.jobs_at_once:
            idx = self.pending[0]
            w = self.worker_for(idx)
            if w is None:
                if not self.running():  # nothing will free GPUs (check_fits rules it out; never wait forever)
                    raise RuntimeError(f"job #{idx} needs {self.needs[idx]} GPU(s) and none of the free ones "
                                       f"({','.join(self.free) or 'none'}) or idle workers' suffice")
                return  # its GPUs are not free yet: it waits, and so do the jobs after it
            self.pending.popleft()
            if self.lora is not None and w.shared_lora:
                try:
                    self.lora.ensure_healthy()
                except Exception as error:  # noqa: BLE001 - the job fails with it, the sweep goes on
                    log.error("job #%d: %s; recorded as failed, the sweep goes on", idx, error)
                    self.returns[idx] = self.failed(idx)
                    continue
            w.job = idx
            w.jobs.put((idx, self.configs[idx]))

    def worker_for(self, idx: int) -> Optional[Worker]:
        """An idle worker that can run job `idx`, a new one where its GPUs are free, or None (it must wait)."""
        shared = self.lora is not None and idx in self.lora.jobs
        idle = [w for w in self.workers.values() if w.job is None]
        if shared or not self.gpus:
            same = [w for w in idle if w.shared_lora == shared]
            if same:
                return same[0]
            if len(self.workers) >= self.jobs_at_once:  # no more processes than jobs at once: one idle goes
                self.retire(idle[0])
            return self.start_worker(self.lora_gpus if shared else None, shared)
        idle_gpu = [w for w in idle if not w.shared_lora]
        placed = place(self.needs[idx], self.free, [w.gpus for w in idle_gpu], self.gpus)
        if placed is None:
            return None
        group, retire = placed
        for w in idle_gpu:
            if w.gpus == group and not retire:
                return w
        for w in idle_gpu:
            if w.gpus in retire:
                self.retire(w)
        self.free = [g for g in self.free if g not in group_ids(group)]
        return self.start_worker(group, False)

    # ------------------------------------------------------------------ workers
    def start_worker(self, gpus: Optional[str], shared_lora: bool) -> Worker:
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        env = os.environ.copy()
        threads = env.get("OMP_NUM_THREADS") or str(worker_threads(self.jobs_at_once))
        os.environ["OMP_NUM_THREADS"] = threads
        if gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
        if shared_lora:
            os.environ.update(self.lora.environment())
        jobs = self.ctx.Queue()
        try:  # a spawned process inherits the environment as it is when it starts
            process = self.ctx.Process(target=worker, args=(slot, jobs, self.results, self.payload),
                                       name=f"grpo-sweep-worker{slot}")
            process.start()
        finally:
            os.environ.clear()
            os.environ.update(env)
        self.workers[slot] = Worker(process, jobs, gpus, shared_lora)
        log.info("worker %d (pid %d)%s, %s CPU threads", slot, process.pid, f" on GPUs {gpus}" if gpus is not None else "",
                 threads)
        return self.workers[slot]

    def retire(self, w: Worker) -> None:
        """An idle worker exits (its kept server stopped); its GPUs come free."""
        slot = next(s for s, x in self.workers.items() if x is w)
        del self.workers[slot]
        if w.process.is_alive():
            w.jobs.put(None)
            w.process.join(timeout=RETIRE_S)
            if w.process.is_alive():
                os.killpg(w.process.pid, signal.SIGKILL)
                w.process.join(timeout=10)
        w.jobs.cancel_join_thread()
        self.release(w)

    def release(self, w: Worker) -> None:
        if w.gpus is not None and not w.shared_lora:
            taken = set(self.free) | set(group_ids(w.gpus))
            self.free = [g for g in self.gpus if g in taken]

    def collect(self) -> None:
        """Take one message from the workers, or notice a worker that died in a job."""
        try:
            _, idx, slot, ret = self.results.get(timeout=1.0)
        except queue.Empty:
            self.replace_dead_workers()
            return
        self.returns[idx] = ret
        if slot in self.workers:
            self.workers[slot].job = None

    def replace_dead_workers(self) -> None:
        for slot, w in list(self.workers.items()):
            if w.process.is_alive():
                continue
            del self.workers[slot]
            self.release(w)
            if w.job is None or w.job in self.returns:
                continue
            log.error("job #%d: its worker (pid %d) exited with code %s; recorded as failed, the sweep goes on",
                      w.job, w.process.pid, w.process.exitcode)
            error = RuntimeError(f"the worker running job #{w.job} exited with code {w.process.exitcode}")
            self.returns[w.job] = self.failed(w.job)
            self.record_failed(w.job, error)

    def record_failed(self, idx: int, error: BaseException) -> None:
        """summary.json of a job whose worker died in it (it could not write its own): `failed`, for grpo.report."""
        from grpo.run_summary import RunSummary

        run_dir = Path(str(self.configs[idx].hydra.sweep.dir)) / str(self.configs[idx].hydra.sweep.subdir)
        if run_dir.is_dir():
            RunSummary(run_dir).fail(error)

    def failed(self, idx: int) -> JobReturn:
        """Job `idx` failed outside its own error handling: its objective is NaN, as train.py returns for a sweep's
        failed job (a FAILED return would make Hydra's sweepers stop the sweep; Optuna records NaN as a failed
        trial)."""
        cfg = self.configs[idx]
        ret = JobReturn(overrides=list(cfg.hydra.overrides.task), hydra_cfg=cfg, status=JobStatus.COMPLETED)
        ret.return_value = float("nan")
        return ret

    def stop(self) -> None:
        """Ctrl-C: every worker stops its job the way Ctrl-C stops a run; those that do not within STOP_GRACE_S are
        killed with their process group."""
        log.warning("stopping the sweep: %d running job(s) stop and keep their last checkpoint; no other starts",
                    len(self.running()))
        self.pending.clear()
        for w in self.workers.values():
            if w.process.is_alive():
                os.kill(w.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self.workers.values():
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                os.killpg(w.process.pid, signal.SIGKILL)
                w.process.join(timeout=10)
            w.jobs.cancel_join_thread()
        self.workers.clear()

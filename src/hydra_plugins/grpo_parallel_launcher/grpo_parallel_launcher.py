"""`hydra/launcher=grpo_parallel hydra.launcher.jobs_at_once=N`: a sweep's jobs N at once on one host.

The launcher places each job on the GPUs its layout needs (`placement.job_gpus`: 1 for shared_vllm or a server
beside the trainer, 2 for broadcast with server.device=1, ...; `hydra.launcher.gpus_per_job` sets it for every job),
from the host's GPUs (`hydra.launcher.gpus`, else CUDA_VISIBLE_DEVICES, else every GPU); a job waits, in sweep
order, until its GPUs are free. A job runs in a worker process (spawned, a session of its own) bound to its GPU
group through CUDA_VISIBLE_DEVICES; a worker runs its jobs one after another the way Hydra's basic launcher does, so
it keeps its vLLM server for its next job of the same settings (server.reuse_across_jobs, grpo.serving.kept). An
idle worker whose GPUs another job needs is retired (its kept server stopped). On a host without GPUs the workers
share the CPUs. `mode=lora_only` jobs train side by side on one vLLM server the launcher starts for them
(`hydra.launcher.share_lora_server`, lora_server.py). A job whose worker dies is recorded as failed and the sweep
goes on; Ctrl-C (or SIGTERM) stops every running job the way Ctrl-C stops a run (its last complete checkpoint kept,
resumable with train.resume) and starts no other.
"""

# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where a dataclass with
# string annotations cannot resolve them.
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from hydra_plugins.grpo_parallel_launcher.lora_server import SharedLoraServer, sharing_jobs
from hydra_plugins.grpo_parallel_launcher.placement import check_fits, job_gpus, visible_gpus
from hydra_plugins.grpo_parallel_launcher.sweep_jobs import Sweep

log = logging.getLogger(__name__)


@dataclass
class GrpoParallelLauncherConf:
    _target_: str = "hydra_plugins.grpo_parallel_launcher.grpo_parallel_launcher.GrpoParallelLauncher"
    # Jobs that run at once (each in a worker process; the others wait for a free one and for their GPUs).
    jobs_at_once: int = 2
    # GPUs every job gets (CUDA_VISIBLE_DEVICES); null = what each job's layout needs. Ignored where no GPU is
    # visible (the jobs then share the host's CPUs).
    gpus_per_job: Optional[int] = None
    # The GPU ids to place jobs on; null = those of CUDA_VISIBLE_DEVICES, else every GPU of the host.
    gpus: Optional[List[int]] = None
    # mode=lora_only jobs train their adapters side by side on one vLLM server the launcher starts (false: each
    # job, or each worker's run of jobs, starts its own as other modes do).
    share_lora_server: bool = True


ConfigStore.instance().store(group="hydra/launcher", name="grpo_parallel", node=GrpoParallelLauncherConf,
                             provider="grpo")


class GrpoParallelLauncher(Launcher):
    """Runs a sweep's jobs `jobs_at_once` at a time in worker processes; see the module docstring."""

    def __init__(self, jobs_at_once: int = 2, gpus_per_job: Optional[int] = None,
                 gpus: Optional[List[int]] = None, share_lora_server: bool = True) -> None:
        super().__init__()
        if int(jobs_at_once) < 1:
            raise ValueError(f"hydra.launcher.jobs_at_once must be >= 1, got {jobs_at_once}")
        self.jobs_at_once = int(jobs_at_once)
        self.gpus_per_job = gpus_per_job
        self.gpus = list(gpus) if gpus else None
        self.share_lora_server = bool(share_lora_server)
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("hydra/launcher=grpo_parallel runs one process per job; it does not launch FSDP2 "
                             "(torchrun) jobs: run such a sweep under torchrun with the basic launcher")
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        configs: Dict[int, DictConfig] = {}
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            configs[idx] = sweep_config
        gpus = visible_gpus(self.gpus)
        needs = {idx: int(self.gpus_per_job or job_gpus(cfg)) for idx, cfg in configs.items()}
        if gpus:
            check_fits(list(needs.items()), gpus)
        shared = sharing_jobs(configs, self.share_lora_server)
        log.info("Launching %d jobs, at most %d at once%s", len(configs), self.jobs_at_once,
                 f" on GPUs {','.join(gpus)}" if gpus else " (no GPU: the jobs share the CPUs)")
        for idx, cfg in configs.items():
            where = "the shared LoRA server" if idx in shared else (f"{needs[idx]} GPU(s)" if gpus else "CPU")
            log.info("\t#%d : %s (%s)", idx, " ".join(filter_overrides(cfg.hydra.overrides.task)), where)
        lora = SharedLoraServer({i: configs[i] for i in shared}, self.jobs_at_once, sweep_dir) if shared else None
        return Sweep(self, configs, needs, gpus, lora).run()



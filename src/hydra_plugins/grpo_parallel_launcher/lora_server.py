"""LoRA configurations at once: the one vLLM server the parallel launcher starts for a sweep's `mode=lora_only` jobs,
which train their adapters against it side by side (`hydra.launcher.share_lora_server`, docs/sweeps.md).

The launcher owns it: it starts it before the first job, with `--max-loras` = the jobs at once (each job's current
adapter in one batch) and `--max-cpu-loras` twice that (each job also keeps its previous adapter while requests on it
finish), and `server.max_lora_rank` = the largest `lora.r` of the jobs; restarts it between jobs when it died; stops
it on Ctrl-C, at the sweep's end and when the launcher dies (the server dies with the process that started it); a
sweeper that launches its jobs in batches (Optuna's n_jobs) gets the same server for its next batch (kept as
grpo.serving.kept keeps a job's server for the next job). Each
job attaches with `server.external_url` (the server's run token in GRPO_SERVER_TOKEN), names its adapters
`job<N>-v<version>` (`mode.adapter_prefix`) and gives each its own weight version (`mode.shared_server`).
"""

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from grpo.schema import ServerConfig

log = logging.getLogger(__name__)

# Server settings that may differ between the jobs sharing the server: the launcher sets them for the server itself.
PER_JOB_SERVER_KEYS = ("max_lora_rank", "port", "reuse_across_jobs")


def shares_server(cfg: DictConfig) -> bool:
    """Whether a job trains its adapter on the shared server: `mode=lora_only` launching one server of its own (not
    attached to one elsewhere, not several replicas), fresh (a resumed job serves its checkpoint's adapter on a
    server of its own)."""
    server = cfg.server
    return (str(cfg.mode.get("_target_", "")).endswith("LoraHotSwapSync") and not server.get("external_url")
            and not server.get("external_urls") and not server.get("devices")
            and int(server.get("replicas") or 1) == 1 and not cfg.train.get("resume"))


def sharing_key(cfg: DictConfig, model_dir: str) -> str:
    """What the sharing jobs must have in common: the base model and every server setting but PER_JOB_SERVER_KEYS."""
    server = {k: v for k, v in OmegaConf.to_container(cfg.server, resolve=True).items() if k not in PER_JOB_SERVER_KEYS}
    return json.dumps({"model": model_dir, "server": server}, sort_keys=True, default=str)


class SharedLoraServer:
    """The sweep's shared LoRA server; see the module docstring."""

    def __init__(self, configs: Dict[int, DictConfig], jobs_at_once: int, sweep_dir: Path) -> None:
        from grpo.recipes.initial_weights import resolve_model_dir

        self.jobs = sorted(configs)
        first = configs[self.jobs[0]]
        self.model_dir = resolve_model_dir(first.model)
        keys = {idx: sharing_key(cfg, resolve_model_dir(cfg.model)) for idx, cfg in configs.items()}
        if len(set(keys.values())) > 1:
            other = next(idx for idx in self.jobs if keys[idx] != keys[self.jobs[0]])
            raise ValueError(f"the sweep's mode=lora_only jobs train side by side on one vLLM server, but jobs "
                             f"#{self.jobs[0]} and #{other} need different servers (base model or server.* settings "
                             "other than max_lora_rank); sweep those in separate sweeps, or give each job a server of "
                             "its own with hydra.launcher.share_lora_server=false")
        extra = [str(a) for a in (first.server.get("extra_args") or [])]
        if any(a.split("=")[0] in ("--max-loras", "--max-cpu-loras") for a in extra):
            raise ValueError("server.extra_args sets --max-loras / --max-cpu-loras, which the parallel launcher sets "
                             "for LoRA jobs at once (the jobs at once, and twice that); drop them")
        # The jobs at once, not this batch's count: a sweeper's batches of trials keep one server (`start`).
        self.max_loras = max(1, jobs_at_once)
        server_cfg = OmegaConf.to_container(first.server, resolve=True)
        # Jobs of another rank need the largest: vLLM refuses an adapter above --max-lora-rank.
        server_cfg["max_lora_rank"] = max(int(cfg.lora.r) for cfg in configs.values())
        self.server_cfg: Dict[str, Any] = server_cfg
        self.key = keys[self.jobs[0]]
        self.log_path = sweep_dir / "lora_server" / "vllm.log"
        self.process: Any = None
        self.restarts = 0

    def start(self, gpus: Optional[str]) -> None:
        """Start the server (on `gpus`, the sharing jobs' GPU group, numbered as their configs number theirs)."""
        from grpo.inference.launch_args import gpus_per_server, server_visible_devices
        from grpo.inference.process import VLLMServer
        from grpo.serving import kept

        # A sweeper's next batch of jobs (Optuna's n_jobs trials at a time) takes the server the batch before kept.
        self.key = json.dumps({"jobs": self.key, "max_loras": self.max_loras, "gpus": gpus,
                               "max_lora_rank": self.server_cfg["max_lora_rank"]}, sort_keys=True)
        taken = kept.take(self.key)
        if taken is not None:
            self.process = taken[0]
            log.info("LoRA jobs at once: %d job(s) on the shared vLLM server of the batch before (pid %s)",
                     len(self.jobs), self.process.pid)
            return
        env = {}
        if gpus is not None:
            device = self.server_cfg.get("device")
            env["CUDA_VISIBLE_DEVICES"] = server_visible_devices(
                int(device) if device is not None else 0, gpus_per_server(self.server_cfg.get("extra_args")), gpus)
        self.process = VLLMServer(
            self.model_dir, self.server_cfg, log_path=self.log_path, enable_lora=True, env=env,
            extra_args=["--max-loras", str(self.max_loras), "--max-cpu-loras", str(2 * self.max_loras)],
            served_model_name=[self.model_dir, *(self.server_cfg.get("served_model_aliases") or [])])
        log.info("LoRA jobs at once: %d job(s) train adapters side by side on one vLLM server (max %d adapters in a "
                 "batch, LoRA rank up to %d; log %s)", len(self.jobs), self.max_loras, self.server_cfg["max_lora_rank"],
                 self.log_path)
        self.process.start()

    def job_config(self, idx: int, cfg: DictConfig) -> None:
        """Point job `idx`'s config at the server: attach by URL, adapters named `job<idx>`, versions per adapter,
        and the server's LoRA rank bound (the job's own check of `lora.r` against it then passes for every rank the
        server takes)."""
        with open_dict(cfg):
            cfg.server.external_url = self.process.url
            cfg.server.max_lora_rank = self.server_cfg["max_lora_rank"]
            cfg.mode.adapter_prefix = f"job{idx}"
            cfg.mode.shared_server = True

    def environment(self) -> Dict[str, str]:
        """What the workers running the sharing jobs need in their environment: the server's run token."""
        from grpo.inference import identity

        return {identity.TOKEN_ENV: self.process.token}

    def ensure_healthy(self) -> None:
        """Before a job starts on it: a server that died (taking its running jobs with it) is started again, at most
        server.max_restarts times in the sweep."""
        # A server busy with every job's requests may answer /health late: only one that exited or stays silent for
        # a minute is restarted.
        if self.process.running() and self.process.healthy(timeout=60.0):
            return
        limit = int(self.server_cfg.get("max_restarts", ServerConfig.max_restarts))
        if self.restarts >= limit:
            raise RuntimeError(f"the shared LoRA server died again after {limit} restarts (server.max_restarts); "
                               f"log {self.log_path}:\n{self.process.log_tail(20)}")
        self.restarts += 1
        log.warning("the shared LoRA server (pid %s) does not answer; restart %d of %d", self.process.pid,
                    self.restarts, limit)
        self.process.restart()

    def stop(self, keep: bool = False) -> None:
        """The batch's end: keep the server for a sweeper's next batch (`keep`, a healthy server; the sweep's end
        stops it: grpo.job.StopKeptServer, atexit), or stop it (Ctrl-C, a server that broke)."""
        from grpo.serving import kept

        if self.process is None:
            return
        if keep and self.restarts == 0 and self.process.healthy():
            kept.keep(self.key, [self.process])
            return
        log.info("stopping the shared LoRA server (pid %s)", self.process.pid)
        self.process.stop()


def sharing_jobs(configs: Dict[int, DictConfig], enabled: bool) -> List[int]:
    """The jobs that train on the shared LoRA server (`enabled`: hydra.launcher.share_lora_server)."""
    return [idx for idx, cfg in sorted(configs.items()) if enabled and shares_server(cfg)]

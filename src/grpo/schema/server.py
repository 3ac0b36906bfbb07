"""Schema of the server group: the vLLM inference server the trainer launches or attaches to."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import List, Optional


class EngineStartMethod(StrEnum):
    """``server.engine_start_method``: how vLLM's API server starts its engine-core process."""

    # A fresh interpreter, which imports vLLM again.
    spawn = "spawn"
    # A copy of the API server process, vLLM already imported.
    fork = "fork"


class SchedulingPolicy(StrEnum):
    """``server.scheduling_policy``: the order in which vLLM admits waiting requests (its --scheduling-policy)."""

    # First come, first served (vLLM's default).
    fcfs = "fcfs"
    # By each request's priority (lower first), then arrival: the held-out evaluation's requests (eval.priority) wait
    # behind the rollouts'.
    priority = "priority"


@dataclass
class ServerConfig:
    """The vLLM inference server the trainer launches (or attaches to)."""

    host: str = "127.0.0.1"
    # null = a free port picked at start-up (the run logs the URL); a fixed port for environments that must know it.
    port: Optional[int] = None
    # Attach to a server someone else started at this URL instead of launching one.
    external_url: Optional[str] = None
    # vLLM servers (replicas) the run launches, each a process of its own on its own port (and GPU: `devices`);
    # requests are spread over them and every sync reaches each (docs/replicas.md).
    replicas: int = 1
    # Attach to several servers started elsewhere (http://host:port each), one replica per URL; the several-URL form
    # of external_url (set one or the other).
    external_urls: Optional[List[str]] = None
    # Share of device memory for weights + KV cache (on CPU: of host memory for the KV cache).
    gpu_memory_utilization: float = 0.2
    # KV cache size in GiB (vLLM --kv-cache-memory-bytes); when set, gpu_memory_utilization no longer sizes it. The
    # CPU engine sizes its KV cache as that share of the first NUMA node's memory minus what the server process
    # already holds, which differs between machines of the same RAM; an explicit size does not.
    kv_cache_gb: Optional[float] = None
    max_model_len: int = 2048
    dtype: str = "auto"
    # fp8: vLLM quantizes the served weights to FP8 itself (--quantization fp8) at start-up and at every reload of
    # synced weights; null serves them as the trainer has them. Start-up checks: a GPU, a sync that reloads through
    # vLLM's loader, an off-policy correction (grpo.config.validate.check_quantized_rollouts).
    quantization: Optional[str] = None
    # null = vLLM decides; true forces eager mode (slower decoding).
    enforce_eager: Optional[bool] = None
    # torch.compile of the served model: null = vLLM decides (on for its GPU engine); false skips it (vLLM's
    # compilation mode 0): a start-up without the compile, CUDA graphs still captured (cuda_graph_sizes). For a small
    # model the compile's fusions gain little and its start-up costs most (bench/gpu/README.md, "Start-up").
    compile: Optional[bool] = None
    # Batch sizes vLLM captures CUDA graphs for; null = vLLM's own list (dozens of sizes). A short list captures in a
    # second; a batch between two sizes runs padded to the next one. With compile=false the graphs are whole decode
    # steps (vLLM's FULL_DECODE_ONLY); prefills run eagerly.
    cuda_graph_sizes: Optional[List[int]] = None
    # null = vLLM decides; false = --no-enable-chunked-prefill (server=cpu: vLLM 0.32's CPU engine dies on a seeded
    # prompt split across steps).
    chunked_prefill: Optional[bool] = None
    max_lora_rank: int = 64
    startup_timeout_s: float = 300.0
    # Restarts of a replica allowed after a crash or a failed health check (each replica counts its own) before the
    # run stops.
    max_restarts: int = 3
    # The most sequences (prompts x n) one /generate request may ask for (grpo-serve --max-sequences-per-request;
    # 0: no bound); more is answered 400. The trainer's own requests split to stay within the default.
    max_sequences_per_request: int = 4096
    extra_args: list[str] = field(default_factory=list)
    # CUDA device index for vLLM when trainer and server share a host, counted as the trainer counts them (within its
    # CUDA_VISIBLE_DEVICES). A server with tensor/pipeline parallel size k in extra_args takes this GPU and the k-1
    # after it (e.g. device=1 with --tensor-parallel-size 3: GPUs 1, 2, 3).
    device: Optional[int] = None
    # First CUDA device index of each replica (one per replica, `replicas` of them); null = `device` for every replica.
    devices: Optional[List[int]] = None
    # Cap (seconds) on how long vLLM's worker busy-polls after each message before sleeping; null = vLLM's 1 s.
    busy_loop_s: Optional[float] = None
    # Other names the served base model answers to besides its directory (e.g. model.name, for Atropos envs).
    served_model_aliases: list[str] = field(default_factory=list)
    # Run vLLM's model worker inside its engine-core process: one process fewer to start and no inter-process hop
    # per engine step. Needs a single worker (no tensor/pipeline/data parallel in extra_args).
    worker_in_engine_process: bool = False
    # A multirun's jobs (one after another in one process) that need the same server take over the one the job
    # before kept, its weights reset to the initial model, instead of starting their own (docs/sweeps.md); false
    # stops it at each job's end. A single run always stops its server.
    reuse_across_jobs: bool = True
    # Start vLLM's processes as soon as the config is checked and the weight sync is built, and load the tokenizer,
    # the trainer's model, the data and the evaluator while vLLM starts; false starts it after them and waits for it
    # there (a run's start-up then takes their time and vLLM's one after the other).
    launch_early: bool = True
    # How vLLM's API server starts its engine-core process: spawn (a fresh interpreter, which imports vLLM again) or
    # fork (a copy of the API server, vLLM already imported: a shorter start-up). null = the environment's
    # VLLM_WORKER_MULTIPROC_METHOD, else spawn. vLLM's CPU engine always spawns; on a GPU vLLM itself spawns when its
    # API server process has initialised CUDA.
    engine_start_method: Optional[EngineStartMethod] = None
    # vLLM's --scheduling-policy. priority: waiting requests are admitted by their priority, so an evaluation beside
    # training (eval.priority > 0) yields the engine to the rollouts; with equal priorities it is first come, first
    # served. null = vLLM's default (fcfs), where a request's priority is refused (HTTP 400).
    scheduling_policy: Optional[SchedulingPolicy] = SchedulingPolicy.priority

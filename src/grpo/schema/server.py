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

    # Interface the server binds.
    host: str = "127.0.0.1"
    # Port of the server (OpenAI API + /generate); null = a free port picked at start-up (the run logs the URL). Set one
    # (it must be free) when an Atropos environment must know it in advance.
    port: Optional[int] = None
    # URL of a server started elsewhere to use instead of launching one; null launches.
    external_url: Optional[str] = None
    # vLLM servers the run launches (replicas), each its own process and port (on GPU: its own device, `devices`);
    # generation is spread over them by load, a group's completions on one replica, and every sync reaches each
    # (docs/replicas.md). A replica that dies is restarted alone while the others serve.
    replicas: int = 1
    # URLs (http://host:port) of several servers started elsewhere, one replica each, instead of launching any; the
    # several-URL form of external_url (set one or the other). null launches `replicas` servers.
    external_urls: Optional[List[str]] = None
    # Share of device memory for weights + KV cache (on CPU: of the first NUMA node's memory, for the KV cache, minus
    # what the server process holds); unused when kv_cache_gb is set.
    gpu_memory_utilization: float = 0.2
    # KV cache size in GiB (vLLM --kv-cache-memory-bytes); when set, gpu_memory_utilization no longer sizes it. The
    # CPU engine sizes its KV cache as that share of the first NUMA node's memory minus what the server process
    # already holds, which differs between machines of the same RAM; an explicit size does not.
    kv_cache_gb: Optional[float] = None
    max_model_len: int = 2048
    # Weight dtype of the served model.
    dtype: str = "auto"
    # fp8: vLLM serves the policy quantized to FP8 (its --quantization fp8, from the synced weights at every reload);
    # null serves the weights as they are. Needs a GPU, mode=none or mode=broadcast (receive=engine), and an off-policy
    # correction on (loss.tis_cap, loss.token_mask or loss.sequence_mask): checked at start-up.
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
    # Largest LoRA rank the server accepts (LoRA modes).
    max_lora_rank: int = 64
    # Seconds to wait for /health after launch.
    startup_timeout_s: float = 300.0
    # Restarts of a replica after a crash or failed health check (each replica's own count) before the run stops with an
    # error.
    max_restarts: int = 3
    # The most sequences (prompts x n) one /generate request may ask for (grpo-serve --max-sequences-per-request;
    # 0: no bound); more is answered 400. The trainer's own requests split to stay within the default.
    max_sequences_per_request: int = 4096
    # Extra vLLM CLI arguments, passed through verbatim.
    extra_args: list[str] = field(default_factory=list)
    # CUDA device index for vLLM when trainer and server share a host, counted as the trainer counts them (within its
    # CUDA_VISIBLE_DEVICES). A server with tensor/pipeline parallel size k in extra_args takes this GPU and the k-1
    # after it (e.g. device=1 with --tensor-parallel-size 3: GPUs 1, 2, 3).
    device: Optional[int] = None
    # First CUDA device index of each replica (one per replica, `replicas` of them); null = `device` for every replica.
    devices: Optional[List[int]] = None
    # Seconds vLLM's worker busy-polls after each message before it sleeps; null keeps vLLM's 1 s (one idle CPU core on
    # a GPU box; cap it, e.g. 0.02, where CPU cores are scarce).
    busy_loop_s: Optional[float] = None
    # Other names the served base model answers to besides its directory (e.g. model.name, for Atropos envs).
    served_model_aliases: list[str] = field(default_factory=list)
    # Run vLLM's model worker inside its engine-core process: one process fewer to start and no inter-process hop
    # per engine step. Needs a single worker (no tensor/pipeline/data parallel in extra_args). false keeps vLLM's own
    # layout, a worker process per GPU, which every GPU figure in bench/ was measured with.
    worker_in_engine_process: bool = False
    # A multirun's jobs that need the same server (same model, server settings and mode) take over the one the job
    # before kept, its served weights reset to the initial model and its prefix cache emptied, instead of starting vLLM
    # again (docs/sweeps.md); false stops it at each job's end. A single run always stops its server.
    reuse_across_jobs: bool = True
    # Start vLLM's processes as soon as the config is checked and the weight sync is built, and load the tokenizer,
    # the trainer's model, the data and the evaluator while vLLM starts; false starts it after them and waits for it
    # there (a run's start-up then takes their time and vLLM's one after the other).
    launch_early: bool = True
    # How vLLM's API server starts its engine-core process: spawn (a fresh interpreter that imports vLLM again) or fork
    # (a copy of the API server, which has not touched CUDA: vLLM is not imported twice, a shorter start-up; vLLM itself
    # spawns instead when that process has initialised CUDA). null = the environment's VLLM_WORKER_MULTIPROC_METHOD,
    # else spawn, what vLLM's own `vllm serve` does.
    engine_start_method: Optional[EngineStartMethod] = None
    # vLLM's --scheduling-policy. priority: waiting requests are admitted by their priority, so an evaluation beside
    # training (eval.priority > 0) yields the engine to the rollouts; with equal priorities it is first come, first
    # served. null = vLLM's default (fcfs), where a request's priority is refused (HTTP 400).
    scheduling_policy: Optional[SchedulingPolicy] = SchedulingPolicy.priority

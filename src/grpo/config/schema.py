"""Typed schemas behind every config group.

Each dataclass is registered in Hydra's ConfigStore and each YAML option of a group lists its schema first in its
defaults, so a misspelled key or a value of the wrong type fails at composition time with the key in the message,
before any model loads. Polymorphic groups (optimizer, mode, data) have one schema per option.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


# ---------------------------------------------------------------- choices (a wrong value fails at composition)
class DType(StrEnum):
    """Training dtype; auto = bfloat16 where the device supports it, else float32."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class KLEstimator(StrEnum):
    """Estimator of KL(pi || ref) per token (Schulman's k1, k2, k3)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class Aggregation(StrEnum):
    """How per-token losses become one number (grpo.trainer.loss)."""

    token_mean = "token_mean"
    seq_mean_token_mean = "seq_mean_token_mean"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"


class AdvantageNorm(StrEnum):
    """How rewards become advantages when the data source sends none."""

    group = "group"
    batch = "batch"
    none = "none"


class LRSchedule(StrEnum):
    """Learning-rate schedule after warmup."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class OldLogprobs(StrEnum):
    """The pi_old of the PPO ratio: vLLM's rollout log-probs, or the trainer's own before the batch's first update."""

    rollout = "rollout"
    recompute = "recompute"


class StalePolicy(StrEnum):
    """Asynchronous rollouts: the generator waits so no group exceeds train.max_staleness, or runs ahead and the
    trainer drops groups that did."""

    wait = "wait"
    drop = "drop"


class Device(StrEnum):
    """Training device; auto = cuda when available."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


# ---------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """Which weights to train and serve."""

    # Hugging Face id or local directory; ignored when `offline` names a preset to build.
    name: str = MISSING
    # Build weights offline from a preset: random (tiny-qwen2, tiny-llama, qwen3b, qwen14b, hermes8b) or warm-started
    # (warm-arith: tiny-qwen2 after a short supervised warm-up on the arithmetic task); null = load `name`.
    offline: Optional[str] = None
    # Seed of the offline random weights.
    seed: int = 0
    # Number of transformer blocks; used to resolve layer presets before the model loads.
    num_layers: int = MISSING
    # Parameter dtype for training: float32, bfloat16, float16 or auto (bf16 where the device supports it).
    dtype: DType = DType.auto
    # Recompute activations in the backward pass (non-reentrant) to save memory.
    gradient_checkpointing: bool = False
    # Longest prompt + completion in tokens; longer sequences are dropped and counted.
    max_seq_len: int = 2048
    # The trainer's attention kernel (transformers' attn_implementation): null = transformers' default (sdpa),
    # or sdpa, eager, varlen (packed rows through PyTorch's flash varlen kernel on CUDA, per-sequence SDPA on CPU:
    # the fast kernel for train.padding_free), flex_attention (CUDA only for training; block-sparse document
    # masks, compiled per new length), flash_attention_2 (needs the flash-attn package).
    attn_implementation: Optional[str] = None
    # torch.compile each decoder block of the trained model (fuses its norms, rotary embedding, gated MLP and
    # residual adds; the attention kernel stays as it is). Compiles once, for dynamic lengths, on the first update.
    compile: bool = False


# ---------------------------------------------------------------- optimizers (kwargs of the constructor)
@dataclass
class AdamWConfig:
    """torch.optim.AdamW."""

    _target_: str = "torch.optim.AdamW"
    # Peak learning rate (after warmup); 1e-3 suits the tiny CPU models, real models want ~1e-6 to 1e-5.
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    # torch's fused AdamW kernel (one launch per step instead of a foreach loop); null = torch's default. torch
    # optimizers only: not passed when null.
    fused: Optional[bool] = None


@dataclass
class AdamW8bitConfig(AdamWConfig):
    """bitsandbytes AdamW with 8-bit optimizer states."""

    _target_: str = "bitsandbytes.optim.AdamW8bit"


@dataclass
class AdafactorConfig:
    """transformers Adafactor with an external learning rate (no relative step)."""

    _target_: str = "transformers.optimization.Adafactor"
    # Peak learning rate (external: relative_step is off).
    lr: float = 1e-3
    weight_decay: float = 0.0
    scale_parameter: bool = False
    relative_step: bool = False
    warmup_init: bool = False
    clip_threshold: float = 1.0


# ---------------------------------------------------------------- loss
@dataclass
class LossConfig:
    """GRPO clipped policy-gradient loss; see grpo.trainer.loss.GRPOLoss."""

    _target_: str = "grpo.trainer.loss.GRPOLoss"
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    aggregation: Aggregation = Aggregation.token_mean
    max_tokens_norm: Optional[int] = None
    # pi_old of the ratio: rollout (vLLM's log-probs) or recompute (one extra forward per rollout batch).
    old_logprobs: OldLogprobs = OldLogprobs.rollout


# ---------------------------------------------------------------- layers
@dataclass
class LayersConfig:
    """Which transformer blocks train (full fine-tuning) or carry LoRA."""

    # all | topN (top N percent) | lastN | firstN | explicit "20-31" / "0-3,28-31".
    indices: str = "all"


# ---------------------------------------------------------------- lora
@dataclass
class LoraConfig:
    """PEFT LoRA settings, used by the LoRA sync modes."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


# ---------------------------------------------------------------- sync modes
@dataclass
class CheckpointRestartSyncConfig:
    """mode=none: full checkpoint, then vLLM reloads the new weights."""

    _target_: str = "grpo.sync.save_and_reload.SaveAndReloadSync"
    sync_every: int = 1
    # inplace: vLLM reloads the saved weights in place (a restart when that fails); restart: always restart vLLM;
    # background: inplace on a thread of its own, the trainer going on meanwhile (generation waits for it).
    reload: str = "inplace"


@dataclass
class LoraRestartSyncConfig:
    """mode=lora_restart: save the adapter, restart vLLM with it preloaded."""

    _target_: str = "grpo.sync.lora_restart.LoraRestartSync"
    sync_every: int = 1


@dataclass
class LoraHotSwapSyncConfig:
    """mode=lora_only: hot-swap the adapter through vLLM's LoRA endpoints."""

    _target_: str = "grpo.sync.lora_hotswap.LoraHotSwapSync"
    sync_every: int = 1


@dataclass
class SharedMemorySyncConfig:
    """mode=shared_vllm: train views of vLLM's own tensors (CUDA IPC on a GPU, a shared file mapping on the CPU)."""

    _target_: str = "grpo.sync.shared_memory.SharedMemorySync"
    sync_every: int = 1
    # Weights change under running generation: no pause around the optimizer step, no prefix-cache reset at the
    # sync; a rollout may then be sampled from a mix of weights, its log-probs still the ones it was sampled with.
    in_flight_updates: bool = False


@dataclass
class NCCLBroadcastSyncConfig:
    """mode=broadcast: trainer and vLLM on different GPUs; NCCL broadcast through vLLM's weight-transfer engine."""

    _target_: str = "grpo.sync.nccl_broadcast.NCCLBroadcastSync"
    sync_every: int = 1
    # Largest packed bucket in MiB (a bigger tensor travels alone).
    bucket_mb: float = 512.0
    # Buckets in flight on the trainer at once (memory: num_buffers x bucket_mb).
    num_buffers: int = 2
    # Cast weights to this dtype before sending (e.g. bfloat16); null = the trainer's dtype.
    transfer_dtype: Optional[str] = None
    # Rendezvous of the trainer-vLLM NCCL group (the trainer hosts it); null port = a free one.
    master_address: str = "127.0.0.1"
    master_port: Optional[int] = None
    # Longest wait for the group to form or one transfer to finish.
    timeout_s: float = 600.0


# ---------------------------------------------------------------- inference server
@dataclass
class ServerConfig:
    """The vLLM inference server the trainer launches (or attaches to)."""

    host: str = "127.0.0.1"
    # null = a free port picked at start-up (the run logs the URL); a fixed port for environments that must know it.
    port: Optional[int] = None
    # Attach to a server someone else started at this URL instead of launching one.
    external_url: Optional[str] = None
    # Share of device memory for weights + KV cache (on CPU: of host memory for the KV cache).
    gpu_memory_utilization: float = 0.2
    # KV cache size in GiB (vLLM --kv-cache-memory-bytes); when set, gpu_memory_utilization no longer sizes it. The
    # CPU engine sizes its KV cache as that share of the first NUMA node's memory minus what the server process
    # already holds, which differs between machines of the same RAM; an explicit size does not.
    kv_cache_gb: Optional[float] = None
    max_model_len: int = 2048
    dtype: str = "auto"
    # null = vLLM decides; true forces eager mode (slower decoding).
    enforce_eager: Optional[bool] = None
    # null = vLLM decides; false = --no-enable-chunked-prefill (server=cpu: vLLM 0.32's CPU engine dies on a seeded
    # prompt split across steps).
    chunked_prefill: Optional[bool] = None
    max_lora_rank: int = 64
    startup_timeout_s: float = 300.0
    # Restarts allowed after a crash or a failed health check before the run stops.
    max_restarts: int = 3
    extra_args: list[str] = field(default_factory=list)
    # CUDA device index for vLLM when trainer and server share a host.
    device: Optional[int] = None
    # Cap (seconds) on how long vLLM's worker busy-polls after each message before sleeping; null = vLLM's 1 s.
    busy_loop_s: Optional[float] = None
    # Other names the served base model answers to besides its directory (e.g. model.name, for Atropos envs).
    served_model_aliases: list[str] = field(default_factory=list)
    # Run vLLM's model worker inside its engine-core process: one process fewer to start and no inter-process hop
    # per engine step. Needs a single worker (no tensor/pipeline/data parallel in extra_args).
    worker_in_engine_process: bool = False


# ---------------------------------------------------------------- data pipelines
@dataclass
class AtroposDataConfig:
    """data=atropos: batches from an Atropos run-api."""

    _target_: str = "grpo.pipeline.atropos.AtroposPipeline"
    url: str = "http://127.0.0.1:8000"
    wandb_group: str = "grpo"
    wandb_project: str = "grpo"
    poll_interval_s: float = 0.5
    max_wait_s: float = 600.0
    max_retries: int = 5
    # Seconds one HTTP request to run-api may take before it counts as failed (and is retried).
    request_timeout_s: float = 60.0


@dataclass
class LocalDataConfig:
    """data=local: built-in rollouts through the inference server."""

    _target_: str = "grpo.pipeline.local.LocalRolloutPipeline"
    task: Any = MISSING
    rewards: dict[str, Any] = field(default_factory=dict)
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # Per-request sampling seeds (a re-run draws the same rollouts); false samples from the engine's own stream.
    seeded_sampling: bool = True
    # vLLM's log-prob of each sampled token (pi_old with loss.old_logprobs=rollout, TIS, grpo/logprob_diff); false
    # trains the rollouts as on-policy (pi_old = the trainer's own log-probs), for one update per synced batch.
    rollout_logprobs: bool = True


# ---------------------------------------------------------------- evaluation (conf/eval/)
@dataclass
class EvalConfig:
    """Held-out evaluation inside the run; see grpo.pipeline.evaluation.Evaluator."""

    _target_: str = "grpo.pipeline.evaluation.Evaluator"
    # null = on when there is a task (local data or eval.task), off for data=atropos.
    enabled: Optional[bool] = None
    # null = data.task; rewards null = data.rewards; max_new_tokens null = data.max_new_tokens.
    task: Any = None
    rewards: Any = None
    correct_reward: Optional[str] = None
    correct_threshold: float = 1.0
    before_train: bool = True
    every: int = 10
    at_end: bool = True
    k: int = 4
    samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    seed: int = 1234
    max_concurrency: int = 16
    samples_logged: int = 4


# ---------------------------------------------------------------- training loop
@dataclass
class TrainConfig:
    """Optimisation loop settings."""

    steps: int = 60
    micro_batch_size: int = 32
    grad_accum: int = 2
    # Passes over each rollout batch (PPO epochs); > 1 lets the policy move away from pi_old so the clip acts.
    ppo_epochs: int = 1
    # Optimizer steps per pass: the rollout batch split into this many shuffled mini-batches.
    mini_batches: int = 1
    seed: int = 0
    # constant | linear | cosine, after warmup.
    lr_schedule: LRSchedule = LRSchedule.constant
    warmup_steps: int = 0
    # null disables gradient clipping.
    max_grad_norm: Optional[float] = 1.0
    # group | batch | none: how rewards become advantages when the server sends none.
    advantage_norm: AdvantageNorm = AdvantageNorm.group
    # Token chunk size of the log-prob computation (never builds [B, T, vocab] float32 logits at once).
    logprob_chunk: int = 512
    # Loss gradient per log-prob chunk in the forward pass (plain lm_head, token-separable loss); else unfused.
    fused_loss: bool = True
    # Run each micro-batch's forward packed into one row without padding (position ids restart per sequence, attention
    # kept per sequence by transformers' packed-sequence masks); same log-probs and loss as the padded path.
    padding_free: bool = False
    # Forward each distinct prompt of a micro-batch once, its completions attending to that one copy (4D mask on
    # sdpa/eager/varlen); same log-probs, loss and gradients, fewer tokens forwarded (grpo.trainer.prefix).
    prefix_sharing: bool = False
    # Leave rows whose advantage is 0 everywhere out of the forward passes (normalisers kept): same loss and
    # gradients for a loss without a KL term (refused otherwise); a GRPO group whose samples all score alike costs
    # nothing to train on.
    skip_zero_advantage: bool = False
    # Micro-batches by a token budget (rows x longest row, or the sum of lengths with padding_free) instead of
    # micro_batch_size rows; null = row count. Normalisers are the update's, so loss and gradients are unchanged.
    max_tokens_per_micro_batch: Optional[int] = None
    checkpoint_every: int = 20
    keep_checkpoints: int = 2
    # Run dir of an earlier run to continue from (its latest checkpoint); null starts fresh.
    resume: Optional[str] = None
    # Stop after this many consecutive steps with a non-finite loss or gradient.
    max_nonfinite_steps: int = 3
    # cpu | cuda | auto.
    device: Device = Device.auto
    # What train.py returns: null = last-10 mean training reward; a metrics key = its last logged value.
    objective: Optional[str] = None
    # Asynchronous rollouts: 0 = synchronous loop; k >= 1 = generation runs ahead in a thread, groups at most k
    # weight versions old (local data pipelines; grpo.pipeline.rollout_queue). data=atropos: 0 = no limit, k >= 1 =
    # older groups dropped (grpo.pipeline.atropos).
    max_staleness: int = 0
    # wait | drop: the generator waits so no group gets older than max_staleness, or runs rollout_queue batches
    # ahead and the trainer drops (counts) groups older than that.
    stale_policy: StalePolicy = StalePolicy.wait
    # stale_policy=drop: rollout batches generated ahead of the trainer at most; null = max_staleness + 1.
    rollout_queue: Optional[int] = None
    # Asynchronous rollouts: rollout batches generating at once (producer threads, so /generate calls at the server);
    # at most the batches the queue bound lets run ahead (max_staleness, or rollout_queue with drop). 1 = one at a time.
    rollout_batches_in_flight: int = 1
    # Threads of the trainer's torch kernels; null = torch's default (one per core). On a CPU machine whose cores
    # the local vLLM server shares, asynchronous rollouts want cores minus the server's threads (its engine decodes
    # while the trainer trains; oversubscribed OpenMP threads wait on each other).
    torch_threads: Optional[int] = None


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl."""

    wandb: bool = False
    wandb_project: str = "grpo"
    wandb_entity: Optional[str] = None
    # TensorBoard event files in <run_dir>/tensorboard (needs the tensorboard package).
    tensorboard: bool = False
    progress_bar: bool = True
    plot: bool = True


@dataclass
class RootConfig:
    """The whole run: one node per config group."""

    model: ModelConfig = MISSING
    optimizer: Any = MISSING
    loss: LossConfig = MISSING
    layers: LayersConfig = MISSING
    lora: LoraConfig = MISSING
    mode: Any = MISSING
    server: ServerConfig = MISSING
    data: Any = MISSING
    eval: Any = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Run name: labels the progress bar and train.log's start-up line, and names the W&B run (logging.wandb).
    name: str = "grpo"


def first_set(*values: Any) -> Any:
    """The first value that is not null (None when all are): `${grpo.first_set:${train.resume},<default dir>}`."""
    return next((v for v in values if v is not None), None)


def config_groups() -> str:
    """`--help`'s list of groups and their options, one line per group, without the `*_schema` entries: those are
    the typed bases the group's YAML files build on (registered in the same groups), not options to pick."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():  # resolved outside a Hydra app (e.g. a saved hydra.yaml)
        return "(python train.py --help lists them)"
    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> list[str]:
        names = [f"{parent}/{g}" if parent else g for g in loader.list_groups(parent)]
        return [g for name in names if not name.startswith("hydra") for g in [name, *groups(name)]]

    lines = []
    for group in sorted(groups("")):
        options = [o for o in sorted(loader.get_group_options(group)) if not o.endswith("_schema")]
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)


def register_configs() -> None:
    """Register every schema (each group YAML names its schema in its defaults list) and our resolvers."""
    # conf/train.yaml's hydra.run.dir: a resumed run continues in the run dir it resumes (train.resume).
    OmegaConf.register_new_resolver("grpo.first_set", first_set, replace=True)
    # conf/train.yaml's hydra.help.template: the groups a user picks from.
    OmegaConf.register_new_resolver("grpo.config_groups", config_groups, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="optimizer", name="adamw_schema", node=AdamWConfig)
    cs.store(group="optimizer", name="adamw_8bit_schema", node=AdamW8bitConfig)
    cs.store(group="optimizer", name="adafactor_schema", node=AdafactorConfig)
    cs.store(group="loss", name="loss_schema", node=LossConfig)
    cs.store(group="layers", name="layers_schema", node=LayersConfig)
    cs.store(group="lora", name="lora_schema", node=LoraConfig)
    cs.store(group="server", name="server_schema", node=ServerConfig)
    cs.store(group="mode", name="none_schema", node=CheckpointRestartSyncConfig)
    cs.store(group="mode", name="lora_restart_schema", node=LoraRestartSyncConfig)
    cs.store(group="mode", name="lora_only_schema", node=LoraHotSwapSyncConfig)
    cs.store(group="mode", name="shared_vllm_schema", node=SharedMemorySyncConfig)
    cs.store(group="mode", name="broadcast_schema", node=NCCLBroadcastSyncConfig)
    cs.store(group="data", name="atropos_schema", node=AtroposDataConfig)
    cs.store(group="data", name="local_schema", node=LocalDataConfig)
    cs.store(group="eval", name="eval_schema", node=EvalConfig)

"""Schemas of the root's train and logging nodes: the optimisation loop and where metrics go."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from grpo.algorithms.advantages import ADVANTAGE_ESTIMATORS
from grpo.algorithms.schedules import LR_SCHEDULES

# ---------------------------------------------------------------- choices
AdvantageNorm = ADVANTAGE_ESTIMATORS.choices(
    "AdvantageNorm", __name__, "How rewards become advantages when the data source sends none "
    "(grpo.algorithms.advantages).")
LRSchedule = LR_SCHEDULES.choices(
    "LRSchedule", __name__, "Learning-rate schedule after warmup (grpo.algorithms.schedules).")


class StalePolicy(StrEnum):
    """``train.stale_policy``: the generator waits so no group exceeds ``train.max_staleness``, or runs ahead and the
    trainer drops (counts) the groups that did (grpo.pipeline.rollout_queue)."""

    wait = "wait"
    drop = "drop"


class Device(StrEnum):
    """Training device; auto = cuda when available."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


# ---------------------------------------------------------------- training loop
@dataclass
class TrainConfig:
    """Optimisation loop settings."""

    # Optimizer steps to run (a multiple of ppo_epochs x mini_batches: rollout batches = steps / that).
    steps: int = 60
    # Sequences per forward/backward pass.
    micro_batch_size: int = 32
    # Micro-batches accumulated per optimizer step.
    grad_accum: int = 2
    # Passes over each rollout batch (PPO epochs); > 1 lets the policy move away from pi_old so the clip acts.
    ppo_epochs: int = 1
    # Optimizer steps per pass: the rollout batch's sequences shuffled (run seed) and split into this many mini-batches.
    mini_batches: int = 1
    # Seed of torch, numpy and the data pipeline.
    seed: int = 0
    # Learning-rate schedule after warmup: constant, linear or cosine (decay to 0 at train.steps).
    lr_schedule: LRSchedule = LRSchedule.constant
    # Linear warmup steps from 0 to optimizer.lr.
    warmup_steps: int = 0
    # Gradient-norm clip; null disables clipping.
    max_grad_norm: Optional[float] = 1.0
    # Advantage from rewards when the server sends none: group (per-group mean/std), batch (group mean, batch std),
    # dr_grpo (group mean only; also named none) or rloo (leave-one-out: the mean of the group's other rewards); or a
    # name you registered (docs/algorithms.md, "An estimator of your own").
    advantage_norm: AdvantageNorm = AdvantageNorm.group
    # Token chunk size of the log-prob computation (never builds [B, T, vocab] float32 logits at once).
    logprob_chunk: int = 512
    # Take the loss's gradient per log-prob chunk in the forward pass (needs a plain lm_head and a token-separable loss
    # such as GRPOLoss; otherwise the chunked log-probs recompute logits in backward). Same result, fewer matmuls.
    fused_loss: bool = True
    # Log grpo/entropy, the policy's mean per-token entropy over the step's loss tokens (docs/algorithms.md), computed
    # exactly from the same chunks of logits as the log-probs: no extra forward, one more pass over each chunk's [chunk,
    # vocab] block (its cost: bench/gpu/README.md, "The entropy metric's cost"). false leaves it out.
    entropy_metric: bool = True
    # Padding-free training: each micro-batch's sequences packed into one row (position ids restart at 0 per sequence;
    # transformers keeps attention within each sequence: a block-diagonal mask on sdpa/eager, varlen kernels on
    # flash-attention, a document mask on flex_attention). Same log-probs and loss as the padded path; no FLOP goes to
    # padding (batch/pad_fraction 0). Off by default: on CPU the tiny models' padded batches are cheaper
    # (docs/performance.md).
    padding_free: bool = False
    # Prefix sharing: each distinct prompt of a micro-batch forwarded once, as one row [prompt, completion_1, ...,
    # completion_n] under a 4D attention mask (completions see the prompt and their own earlier tokens, never each
    # other; position ids continue from the prompt's end). Same log-probs, loss and gradients; a GRPO group's prompt
    # costs one forward instead of n. Needs sdpa, eager or varlen attention and a single-process trainer; refused beside
    # padding_free (it lays out its own rows). docs/performance.md.
    prefix_sharing: bool = False
    # Leave the rows whose advantage is 0 at every token (a GRPO group whose samples all scored alike) out of the
    # forward and backward passes. Their loss terms are multiples of the advantage, so the loss, the gradients and the
    # optimizer step stay the same (the normalisers still count them); only the loss metrics (clip fraction, entropy,
    # ...) average over the rows forwarded. Refused with a KL penalty (loss.kl_coef > 0), which those rows do add to.
    # batch/rows_left_out counts them.
    skip_zero_advantage: bool = False
    # Token budget of a micro-batch: sequences sorted by length and grouped while rows x longest row (or, with
    # padding_free, the sum of lengths) stays within it; a longer sequence gets a micro-batch of its own. null = groups
    # of train.micro_batch_size rows. The loss is normalised over the whole update, so loss and gradients are the same.
    max_tokens_per_micro_batch: Optional[int] = None
    # With max_tokens_per_micro_batch null: a micro-batch of micro_batch_size rows whose forward would run more tokens
    # than a cap derived from the device (its free memory and the model's size on a GPU; 65536 on CPU, above what the
    # default job forwards) is split further by that cap; the start-up log says the cap. false: rows only.
    auto_token_budget: bool = True
    # Save a checkpoint every N optimizer steps (and at the end, unless save_final_checkpoint is false).
    checkpoint_every: int = 20
    # Save a checkpoint after the last step (model and optimizer state: 3x the weights' size with AdamW). false for a
    # smoke run that nobody resumes: its run dir then holds no weights beyond what the sync mode writes.
    save_final_checkpoint: bool = True
    # Checkpoints kept on disk (older ones are deleted after a newer one is complete).
    keep_checkpoints: int = 2
    # Run dir of an earlier run to continue from (its latest checkpoint); null starts fresh.
    resume: Optional[str] = None
    # Stop after this many consecutive non-finite losses or gradients (each such step is skipped).
    max_nonfinite_steps: int = 3
    # Training device: auto (cuda when available), cuda or cpu.
    device: Device = Device.auto
    # What train.py returns (sweeps maximise it): null = mean training reward of the last 10 rollout batches; a metrics
    # key (e.g. eval/accuracy, eval/pass@k) = its last logged value.
    objective: Optional[str] = None
    # Asynchronous rollouts (local data pipelines): 0 = the synchronous loop (generate, train, sync); k >= 1 = a
    # producer thread generates the next rollout batches while the trainer trains, and no group is trained on weights
    # more than k versions (syncs) old. Off-policy by up to k syncs: keep loss.old_logprobs=rollout (the ratio is taken
    # against vLLM's log-probs), or set loss.tis_cap with old_logprobs=recompute. data=atropos (async by itself; never
    # wrapped in the producer): 0 = no limit, k >= 1 = groups whose environment-reported weight version is more than k
    # behind the trainer's are dropped (needs stale_policy=drop; lag is reported either way, async/staleness_*).
    # docs/async.md.
    max_staleness: int = 0
    # With max_staleness >= 1: wait = the generator starts a batch only when it cannot be more than max_staleness
    # versions old when trained (once the trainer has finished the batch max_staleness + 1 before it; nothing dropped);
    # drop = it runs up to rollout_queue batches ahead and the trainer drops (and counts, async/dropped_groups) groups
    # older than max_staleness. data=atropos: drop only (the trainer cannot make environments wait).
    stale_policy: StalePolicy = StalePolicy.wait
    # stale_policy=drop: most rollout batches generated ahead of the trainer; null = max_staleness + 1. Local data
    # pipelines only (data=atropos: run-api holds the queue; leave it null).
    rollout_queue: Optional[int] = None
    # With max_staleness >= 1: rollout batches generating at once (producer threads, each with its /generate call at the
    # server). 2 lets vLLM's API process work on one call while its engine computes the other (bench/README.md); at most
    # max_staleness + 1 (wait) or rollout_queue (drop). Local data pipelines only.
    rollout_batches_in_flight: int = 1
    # Threads of the trainer's torch kernels; null = torch's default (one per core). On a CPU machine whose cores
    # the local vLLM server shares, asynchronous rollouts want cores minus the server's threads (its engine decodes
    # while the trainer trains; oversubscribed OpenMP threads wait on each other).
    torch_threads: Optional[int] = None


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl."""

    # Log to Weights & Biases (offline when WANDB_API_KEY is unset).
    wandb: bool = False
    # W&B project name.
    wandb_project: str = "grpo"
    # W&B entity (team); null = your default.
    wandb_entity: Optional[str] = None
    # Also write TensorBoard event files into <run_dir>/tensorboard (`pip install tensorboard`; view: tensorboard
    # --logdir outputs).
    tensorboard: bool = False
    # Show a progress bar on stderr.
    progress_bar: bool = True
    # Write curves.png (reward and loss against step) into the run dir at the end.
    plot: bool = True

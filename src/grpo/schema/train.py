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
    # group | batch | dr_grpo (= none) | rloo | a registered name: how rewards become advantages when the server
    # sends none.
    advantage_norm: AdvantageNorm = AdvantageNorm.group
    # Token chunk size of the log-prob computation (never builds [B, T, vocab] float32 logits at once).
    logprob_chunk: int = 512
    # Loss gradient per log-prob chunk in the forward pass (plain lm_head, token-separable loss); else unfused.
    fused_loss: bool = True
    # grpo/entropy: each loss token's entropy from the log-probs' chunks of logits (one more pass over each chunk).
    entropy_metric: bool = True
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
    # With max_tokens_per_micro_batch null: a micro-batch of micro_batch_size rows whose forward would run more
    # tokens than a cap derived from the device (its free memory and the model's size on a GPU; 65536 on CPU) is
    # split further by that cap, said in the start-up log (grpo.trainer.token_cap). false: rows only.
    auto_token_budget: bool = True
    checkpoint_every: int = 20
    # Save a checkpoint after the last step; false: only every checkpoint_every steps (a smoke run nobody resumes).
    save_final_checkpoint: bool = True
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
    # at most the batches the queue bound lets run ahead (max_staleness + 1, or rollout_queue with drop). 1 = one at a
    # time.
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

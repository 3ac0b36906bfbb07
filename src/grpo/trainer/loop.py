"""The GRPO optimisation loop: groups in, optimizer steps out, weights pushed to vLLM, checkpoints and metrics."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig

from grpo import faults
from grpo.inference.client import InferenceServerError
from grpo.pipeline.base import DataPipeline
from grpo.pipeline.batch import prepare_batch
from grpo.sync.base import SyncStrategy
from grpo.trainer.checkpoint import CheckpointManager
from grpo.trainer.logprobs import can_fuse, fused_token_loss, token_logprobs
from grpo.trainer.metrics import MetricsLogger

log = logging.getLogger(__name__)


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is in KiB on Linux


def process_stats() -> dict[str, float]:
    """Current RSS and open file descriptors of this process (Linux /proc; empty elsewhere), for leak watching."""
    import os

    try:
        rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        return {}
    return {"memory/rss_gb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 1024**3, "proc/open_fds": float(fds)}


class StepEvaluator(Protocol):
    """What the loop needs of an evaluator (grpo.pipeline.evaluation.Evaluator; typed here so the trainer does not
    import the pipeline)."""

    def due(self, step: int, total_steps: int) -> bool: ...

    def evaluate(self, step: int) -> dict[str, float]: ...


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN/Inf loss or gradient."""


class GRPOTrainer:
    """Runs `train.steps` optimizer steps; each step pulls groups, computes the GRPO loss, steps and syncs."""

    def __init__(
        self,
        *,
        train_cfg: DictConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loss_fn: Any,
        pipeline: DataPipeline,
        sync: SyncStrategy,
        checkpoints: CheckpointManager,
        metrics: MetricsLogger,
        max_seq_len: int,
        device: torch.device,
        start_step: int = 0,
        dist: Any = None,
        evaluator: StepEvaluator | None = None,
    ) -> None:
        self.cfg = train_cfg
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.pipeline = pipeline
        self.sync = sync
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.max_seq_len = max_seq_len
        self.device = device
        self.step = start_step
        # grpo.trainer.distributed.DistInfo under torchrun (FSDP2); None in a single process.
        self.dist = dist if dist is not None and dist.enabled else None
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.vocab_size = model.get_input_embeddings().num_embeddings
        # The loss's gradient taken chunk by chunk in the forward (3 matmuls per chunk instead of 4); FSDP2 keeps
        # the unfused path, whose forward method it registers (grpo.trainer.distributed.shard_model).
        self.fused = bool(train_cfg.fused_loss) and self.dist is None and can_fuse(model, loss_fn)
        self.rewards: list[float] = []
        # Held-out eval (rank 0 only; None when off). It runs after a step's sync, so it samples that step's weights.
        self.evaluator = evaluator
        if device.type == "cuda":
            # Peaks are per run: a multirun's earlier jobs must not leak into this one's figures.
            torch.cuda.reset_peak_memory_stats(device)

    def fit(self) -> list[float]:
        """Train until `train.steps`; returns the mean reward of every step run (for sweeps)."""
        if self.evaluator is not None and self.step == 0 and self.evaluator.due(0, self.cfg.steps):
            self.metrics.log({"step": 0, **self.evaluator.evaluate(0)})  # before_train: the initial weights
        while self.step < self.cfg.steps:
            faults.server_faults(self.step + 1, getattr(self.sync, "server", None))
            self.sync.check_health()
            row = self.train_step()
            if (self.step % self.cfg.checkpoint_every == 0) or self.step == self.cfg.steps:
                self.save_checkpoint()  # FSDP2: every rank joins the gathers, rank 0 writes
            if self.evaluator is not None and self.evaluator.due(self.step, self.cfg.steps):
                row.update(self.evaluator.evaluate(self.step))
            self.metrics.log(row)
        return self.rewards

    def save_checkpoint(self) -> Path | None:
        """Atomic checkpoint of model (or adapter), optimizer, scheduler, RNG, data position and counters. Under
        FSDP2 every rank must call it; rank 0 writes and gets the path, the others None."""
        state = {"step": self.step, "data": self.pipeline.state_dict(), "weight_version": self.sync.version,
                 "nonfinite_total": self.nonfinite_total}
        save = self.checkpoints.save_distributed if self.dist is not None else self.checkpoints.save
        return save(self.step, self.model, self.tokenizer, self.optimizer, self.scheduler, state)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its metrics row."""
        t_start = time.perf_counter()
        faults.point("generate", self.step + 1)
        try:
            groups = self.pipeline.next_groups(self.step)
        except InferenceServerError:
            # The server died while generating: restart it (bounded by server.max_restarts; raises when used up
            # or when the server is healthy, i.e. the error was not a crash) and generate this step again.
            if not self.sync.check_health():
                raise
            groups = self.pipeline.next_groups(self.step)
        t_data = time.perf_counter()
        batch = prepare_batch(
            groups,
            advantage_norm=self.cfg.advantage_norm,
            max_seq_len=self.max_seq_len,
            micro_batch_size=self.cfg.micro_batch_size,
            pad_token_id=self.tokenizer.pad_token_id,
            vocab_size=self.vocab_size,
        )
        row: dict[str, Any] = {"step": self.step + 1}
        row.update(self.pipeline.metrics())
        row.update(batch.metrics)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_total = 0.0
        micro_batches, scale = [(mb, 1.0) for mb in batch.micro_batches], 1.0
        if self.dist is not None:
            from grpo.trainer import distributed

            # This rank's share; zero-weighted repeats keep every rank's FSDP collectives in step.
            mine, pad = distributed.rank_share(batch.micro_batches, self.dist.rank, self.dist.world_size)
            micro_batches = [(mb, 1.0) for mb in mine] + [(batch.micro_batches[0], 0.0)] * pad
            scale = distributed.loss_scale(self.dist.world_size)
        for mb, weight in micro_batches:
            mb = mb.to(self.device)

            def loss_of(logprobs, mb=mb, with_metrics=True):
                return self.loss_fn(
                    logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask,
                    ref_logprobs=mb.ref_logprobs, total_tokens=batch.num_loss_tokens,
                    total_sequences=batch.num_sequences, max_tokens=batch.max_completion_tokens,
                    with_metrics=with_metrics,
                )

            if self.fused:
                loss, m, _ = fused_token_loss(
                    self.model, mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures, loss_of,
                    chunk_size=self.cfg.logprob_chunk,
                )
            else:
                # FSDP2 registers the model's own forward method for this (grpo.trainer.distributed.shard_model).
                fn = getattr(self.model, "grpo_token_logprobs", None)
                logprobs = (fn or token_logprobs)(
                    *(() if fn else (self.model,)), mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures,
                    chunk_size=self.cfg.logprob_chunk,
                )
                loss, m = loss_of(logprobs)
            if faults.active("nan_loss", self.step + 1):
                loss = loss * float("nan")
            if weight == 0.0:
                (loss * 0.0).backward()
                continue
            (loss * scale if scale != 1.0 else loss).backward()
            loss_total += float(loss.detach())
            # Token-weighted average of the micro-batch metrics over the step.
            w = float(mb.loss_mask.sum()) / max(batch.num_loss_tokens, 1)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + w * float(v)
        if self.dist is not None:
            reduced = distributed.all_reduce_sum({**sums, "__loss": loss_total}, self.dist.device)
            loss_total = reduced.pop("__loss")
            sums = reduced
        t_fwd = time.perf_counter()

        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm) if self.params else 0.0
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
        if finite:
            self.nonfinite_in_a_row = 0
            self.sync.before_optimizer_step()
            try:
                faults.point("optimizer_step", self.step + 1)
                self.optimizer.step()
            finally:
                self.sync.after_optimizer_step()
            self.scheduler.step()
        else:
            # A NaN step would poison Adam's moments for good; skip it and count.
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            log.warning("step %d: non-finite loss (%s) or grad norm (%s); step skipped", self.step + 1, loss_total, grad_norm)
            if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.nonfinite_in_a_row} consecutive steps had a non-finite loss or gradient "
                    f"(train.max_nonfinite_steps={self.cfg.max_nonfinite_steps}); lower optimizer.lr or check the data"
                )
        self.step += 1
        t_opt = time.perf_counter()

        sync_metrics: dict[str, float] = {"sync/seconds": 0.0, "sync/version": float(self.sync.version)}
        if self.step % self.sync.sync_every == 0 or self.step == self.cfg.steps:
            sync_metrics = self.sync.sync(self.model, self.step)
        t_end = time.perf_counter()

        row.update(sums)
        row.update(sync_metrics)
        row.update({
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "train/skipped_nonfinite": float(self.nonfinite_total),
            "time/data_seconds": t_data - t_start,
            "time/train_seconds": t_opt - t_data,
            "time/forward_backward_seconds": t_fwd - t_data,
            "time/step_seconds": t_end - t_start,
        })
        row.setdefault("tokens/trained", float(batch.num_loss_tokens))
        row["throughput/trained_tokens_per_s"] = row["tokens/trained"] / max(t_opt - t_data, 1e-9)
        row["memory/peak_gb"] = peak_memory_gb(self.device)
        row.update(process_stats())
        if "reward/mean" in row:
            self.rewards.append(float(row["reward/mean"]))
        return row

"""The GRPO optimisation loop: groups in, optimizer steps out, weights pushed to vLLM, checkpoints and metrics."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig

from grpo import faults
from grpo.sync.base import SyncStrategy
from grpo.trainer import distributed
from grpo.trainer.batch import BatchSource, PreparedBatch, TrainBatch
from grpo.trainer.checkpoint import CheckpointManager
from grpo.trainer.logprobs import can_fuse, fused_token_loss, token_logprobs
from grpo.trainer.metrics import MetricsLogger, NullMetrics

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


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN/Inf loss or gradient."""


class GRPOTrainer:
    """Runs `train.steps` optimizer steps; each step pulls a batch, computes the GRPO loss, steps and syncs."""

    def __init__(
        self,
        *,
        train_cfg: DictConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loss_fn: Any,
        pipeline: BatchSource,
        sync: SyncStrategy,
        checkpoints: CheckpointManager,
        metrics: MetricsLogger | NullMetrics,
        device: torch.device,
        start_step: int = 0,
        dist: Optional[distributed.DistInfo] = None,
        logprob_fn: Optional[Callable[..., torch.Tensor]] = None,
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
        self.device = device
        self.step = start_step
        # Under torchrun (FSDP2) the ranks' roles; None in a single process.
        self.dist = dist if dist is not None and dist.enabled else None
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        # The loss's gradient taken chunk by chunk in the forward (3 matmuls per chunk instead of 4); FSDP2 keeps
        # the unfused path through its registered forward method (`logprob_fn`, distributed.sharded_token_logprobs).
        self.fused = bool(train_cfg.fused_loss) and self.dist is None and can_fuse(model, loss_fn)
        self.token_logprobs = logprob_fn or (lambda *batch, **kw: token_logprobs(model, *batch, **kw))
        self.rewards: list[float] = []
        if device.type == "cuda":
            # Peaks are per run: a multirun's earlier jobs must not leak into this one's figures.
            torch.cuda.reset_peak_memory_stats(device)

    def fit(self) -> list[float]:
        """Train until `train.steps`; returns the mean reward of every step run (for sweeps)."""
        while self.step < self.cfg.steps:
            self.sync.prepare_step(self.step + 1)
            row = self.train_step()
            if (self.step % self.cfg.checkpoint_every == 0) or self.step == self.cfg.steps:
                self.save_checkpoint()  # FSDP2: every rank joins the gathers, rank 0 writes
            self.metrics.log(row)
        return self.rewards

    def save_checkpoint(self) -> Path | None:
        """Atomic checkpoint of model (or adapter), optimizer, scheduler, RNG, data position and counters. Under
        FSDP2 every rank must call it; rank 0 writes and gets the path, the others None."""
        state = {"step": self.step, "data": self.pipeline.state_dict(), "weight_version": self.sync.version,
                 "nonfinite_total": self.nonfinite_total}
        save = self.checkpoints.save_distributed if self.dist is not None else self.checkpoints.save
        return save(self.step, self.model, self.tokenizer, self.optimizer, self.scheduler, state)

    # ------------------------------------------------------------------ one optimizer step, phase by phase
    def train_step(self) -> dict[str, Any]:
        """One optimizer step: fetch → forward/backward → optimizer → sync → metrics; returns its metrics row."""
        t_start = time.perf_counter()
        batch = self.fetch_batch()
        t_data = time.perf_counter()
        row: dict[str, Any] = {"step": self.step + 1, **self.pipeline.metrics(), **batch.metrics}
        loss_total, loss_metrics = self.forward_backward(batch)
        t_fwd = time.perf_counter()
        grad_norm = self.optimizer_step(loss_total)
        self.step += 1
        t_opt = time.perf_counter()
        row.update(loss_metrics)
        row.update(self.maybe_sync())
        t_end = time.perf_counter()
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

    def fetch_batch(self) -> PreparedBatch:
        """This step's batch. A server that died while generating is restarted by the sync strategy (bounded by
        server.max_restarts; it raises when they are used up) and the step's generation runs again once."""
        faults.point("generate", self.step + 1)
        try:
            return self.pipeline.next_batch(self.step)
        except Exception as error:
            if not self.sync.recover(error):
                raise
        return self.pipeline.next_batch(self.step)

    def forward_backward(self, batch: PreparedBatch) -> tuple[float, dict[str, float]]:
        """Gradients of the step's loss, accumulated over its micro-batches; (summed loss, token-weighted
        metrics). Under FSDP2 each rank runs its share, zero-weighted repeats keep the ranks' collectives in step."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_total = 0.0
        micro_batches, scale = [(mb, 1.0) for mb in batch.micro_batches], 1.0
        if self.dist is not None:
            mine, pad = distributed.rank_share(batch.micro_batches, self.dist.rank, self.dist.world_size)
            micro_batches = [(mb, 1.0) for mb in mine] + [(batch.micro_batches[0], 0.0)] * pad
            scale = distributed.loss_scale(self.dist.world_size)
        for mb, weight in micro_batches:
            mb = mb.to(self.device)
            loss, m = self.micro_batch_loss(mb, batch)
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
        return loss_total, sums

    def micro_batch_loss(self, mb: TrainBatch, batch: PreparedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of one micro-batch (normalised by the whole step's counts) and its metrics."""

        def loss_of(logprobs: torch.Tensor, with_metrics: bool = True) -> tuple[torch.Tensor, dict[str, Any]]:
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
            return loss, m
        logprobs = self.token_logprobs(
            mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures, chunk_size=self.cfg.logprob_chunk
        )
        return loss_of(logprobs)

    def optimizer_step(self, loss_total: float) -> float:
        """Clip, then step the optimizer and the schedule when loss and gradient are finite; a non-finite step is
        skipped and counted (raises after train.max_nonfinite_steps in a row). Returns the gradient norm."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm) if self.params else 0.0
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if math.isfinite(loss_total) and math.isfinite(grad_norm):
            self.nonfinite_in_a_row = 0
            self.sync.before_optimizer_step()
            try:
                faults.point("optimizer_step", self.step + 1)
                self.optimizer.step()
            finally:
                self.sync.after_optimizer_step()
            self.scheduler.step()
            return grad_norm
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
        return grad_norm

    def maybe_sync(self) -> dict[str, float]:
        """Push the weights to the server every `mode.sync_every` steps and after the last one."""
        if self.step % self.sync.sync_every == 0 or self.step == self.cfg.steps:
            return self.sync.sync(self.model, self.step)
        return {"sync/seconds": 0.0, "sync/version": float(self.sync.version)}

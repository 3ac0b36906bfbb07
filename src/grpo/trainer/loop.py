"""The GRPO optimisation loop: groups in, optimizer steps out, weights pushed to vLLM, checkpoints and metrics."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from grpo import faults
from grpo.algorithms.aggregation import Totals
from grpo.schema.train import TrainConfig
from grpo.sync.base import SyncStrategy
from grpo.trainer import fsdp
from grpo.trainer.checkpoint import CheckpointManager
from grpo.trainer.evaluations import LoopEvaluations, StepEvaluator
from grpo.trainer.logprobs import can_fuse, fused_token_loss, token_logprobs
from grpo.trainer.loss_interface import LossInputs, PolicyLoss, check_skip_zero_advantage, take_loss
from grpo.trainer.metrics import MetricsLogger, NullMetrics
from grpo.trainer.metrics_rows import BatchTimes, device_peak, fill_batch_rows, forward_perf, model_flops
from grpo.trainer.minibatch import (
    capped_split,
    rollout_batches,
    token_budget_split,
    update_plan,
    updates_per_batch,
    without_zero_advantage_rows,
)
from grpo.trainer.out_of_memory import TrainerOutOfMemoryError, out_of_memory_advice
from grpo.trainer.recovery import retried_after_recovery
from grpo.trainer.reference import ReferencePolicy
from grpo.trainer.token_cap import micro_batch_token_cap
from grpo.trainer.train_batch import BatchSource, PreparedBatch, TrainBatch
from grpo.trainer.wall_clock import WallClock

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN/Inf loss or gradient."""


class GRPOTrainer:
    """Runs `train.steps` optimizer steps; each step pulls a batch, computes the GRPO loss, steps and syncs."""

    def __init__(
        self,
        *,
        train_cfg: TrainConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loss_fn: PolicyLoss,
        pipeline: BatchSource,
        sync: SyncStrategy,
        checkpoints: CheckpointManager,
        metrics: MetricsLogger | NullMetrics,
        device: torch.device,
        start_step: int = 0,
        start_batch: Optional[int] = None,
        loss_state: Optional[dict[str, Any]] = None,
        reference: Optional[ReferencePolicy] = None,
        dist: Optional[fsdp.DistInfo] = None,
        logprob_fn: Optional[Callable[..., torch.Tensor]] = None,
        evaluator: Optional[StepEvaluator] = None,
        clock: Optional[WallClock] = None,
    ) -> None:
        self.cfg = train_cfg
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        # What the loss asks of the trainer: pi_old recomputed by one extra forward per rollout batch
        # (loss.old_logprobs), the KL penalty's frozen initial policy (`reference`, one forward per rollout batch),
        # the entropies with their gradient (an entropy bonus), its token-separability (the fused path's passes).
        self.loss_needs = take_loss(loss_fn, loss_state, reference)
        self.reference = reference
        self.pipeline = pipeline
        self.sync = sync
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.device = device
        self.step = start_step
        # Rollout batches done (the data source's index); a run resumes at a batch boundary.
        self.batch_number = rollout_batches(train_cfg, start_step, start_batch)[0]
        # Under torchrun (FSDP2) the ranks' roles; None in a single process.
        self.dist = dist if dist is not None and dist.enabled else None
        self.nonfinite_in_a_row = self.nonfinite_total = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.set_forward_path(train_cfg, model, device, logprob_fn)
        self.flops, self.peak = model_flops(model), device_peak(model, device)
        self.rewards: list[float] = []
        # Where this session's wall clock goes (summary.json's wall_clock); a private one when none is given.
        self.clock = clock if clock is not None else WallClock()
        # Held-out eval (rank 0 only; none when off), blocking or beside training (grpo.trainer.evaluations); a
        # server that died under one is restarted by the server's recover.
        self.evaluations = LoopEvaluations(evaluator, lambda error: self.sync.server.recover(error), self.clock)

    def set_forward_path(self, train_cfg: TrainConfig, model: torch.nn.Module, device: torch.device,
                         logprob_fn: Optional[Callable[..., torch.Tensor]]) -> None:
        """How the update's forwards run: fused or not, packed, prompts shared, rows left out, the token budget; the
        device's memory peaks from here on."""
        # The loss's gradient taken chunk by chunk in the forward (3 matmuls per chunk instead of 4); FSDP2 keeps
        # the unfused path through its registered forward method (`logprob_fn`, fsdp.sharded_token_logprobs).
        self.fused = bool(train_cfg.fused_loss) and self.dist is None and can_fuse(model)
        # grpo/entropy from the log-probs' own chunks of logits (train.entropy_metric).
        self.entropy_metric = bool(getattr(train_cfg, "entropy_metric", True))
        self.token_logprobs = logprob_fn or (lambda *batch, **kw: token_logprobs(model, *batch, **kw))
        # Padding-free forwards (each micro-batch packed into one row) and the token budget of a micro-batch.
        self.packed = bool(train_cfg.padding_free)
        # Each distinct prompt of a micro-batch forwarded once, its completions attending to it (grpo.trainer.prefix).
        self.shared = bool(getattr(train_cfg, "prefix_sharing", False))
        # Rows whose advantage is 0 everywhere left out of the forward passes (the loss must gain nothing from them).
        self.skip_zero_advantage = bool(getattr(train_cfg, "skip_zero_advantage", False))
        check_skip_zero_advantage(self.skip_zero_advantage, self.loss_fn)
        self.max_tokens = train_cfg.max_tokens_per_micro_batch
        # Without an explicit budget, micro_batch_size rows each split further where their forward would exceed a
        # cap derived from the device (train.auto_token_budget; grpo.trainer.token_cap).
        self.token_cap = micro_batch_token_cap(train_cfg, model, device, self.dist)
        if device.type == "cuda":
            # Peaks are per run: a multirun's earlier jobs must not leak into this one's figures.
            torch.cuda.reset_peak_memory_stats(device)

    @property
    def layout(self) -> dict[str, bool]:
        """The forward layout's keyword arguments of the log-prob functions (``shared`` only when on, so a custom
        ``logprob_fn`` that predates it still works)."""
        return {"packed": self.packed, "shared": True} if self.shared else {"packed": self.packed}

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps per rollout batch: `train.ppo_epochs` passes x `train.mini_batches` mini-batches."""
        return updates_per_batch(self.cfg)

    def fit(self) -> list[float]:
        """Train until `train.steps` optimizer steps; returns the mean reward of every rollout batch (for sweeps)."""
        # Wall-clock of every row since this session's loop began (a resumed run starts again at 0): what
        # time-to-accuracy curves plot; the server's start-up before it is in summary.json's wall_seconds.
        t_fit = time.perf_counter()
        self.clock.loop_started()
        try:
            start_row = self.evaluations.at_start(self.step, self.cfg.steps, self.metrics.logged)
            if start_row is not None:
                self.log_row(start_row, t_fit)
            while self.step < self.cfg.steps:
                self.sync.server.prepare_step(self.step + 1)
                first = self.step
                rows, failed = self.train_batch()
                if failed is None and self.evaluations.due_after(first, self.step, self.cfg.steps):
                    try:
                        self.evaluations.start(self.step, rows[-1])
                    except BaseException as error:  # the steps were trained (a SIGTERM too): their rows first, then raise
                        failed = error
                rows[-1]["time/eval_wait_seconds"] = self.evaluations.take_wait()
                # The rows go to disk before the checkpoint that holds these steps' weights: a run stopped or failing
                # inside the checkpoint write has them, and a resume from an older checkpoint trims them
                # (MetricsLogger), so every step is in metrics.jsonl exactly once.
                self.log_rows(rows, t_fit)
                if self.evaluations.background is not None:
                    self.log_rows(self.evaluations.rows(self.evaluations.background.finished()), t_fit)
                if failed is not None:
                    raise failed
                every = self.cfg.checkpoint_every
                final = self.step == self.cfg.steps and getattr(self.cfg, "save_final_checkpoint", True)
                if self.step // every > first // every or final:
                    self.checkpoint(t_fit)
            if self.evaluations.background is not None:  # the last evaluations complete before the run does
                self.log_rows(self.evaluations.rows(self.evaluations.background.wait(), last=True), t_fit)
                self.evaluations.take_wait()  # into the wall clock when no row was left to carry it
        finally:
            self.clock.loop_ended()
        return self.rewards

    def checkpoint(self, t_fit: float) -> None:
        """Write a checkpoint at a rollout-batch boundary (FSDP2: every rank joins, rank 0 writes), after the rows
        of the evaluations of earlier steps (beside training): a resume from it cannot evaluate their weights
        again. The evaluation of this step may still run: a resume evaluates it when its row is missing."""
        if self.evaluations.background is not None:
            self.log_rows(self.evaluations.rows(self.evaluations.background.wait(before=self.step)), t_fit)
        t0 = time.perf_counter()
        self.metrics.flush()
        self.save_checkpoint()
        self.clock.add("checkpoint", time.perf_counter() - t0)

    def close(self) -> None:
        """Drop the model, its gradients and the optimizer state (the job's device memory), so nothing that still
        refers to the trainer (a traceback, a sweeper) keeps them alive between multirun jobs. The trainer is unusable after."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()  # torch's Optimizer.state: the per-parameter moments
        if self.reference is not None:
            self.reference.close()
        self.model = self.optimizer = self.scheduler = self.token_logprobs = self.reference = None
        self.params = []

    def log_row(self, row: dict[str, Any], t_fit: float) -> None:
        """Log one metrics row with `time/run_seconds`, the wall-clock since the loop began at `t_fit`."""
        self.metrics.log({**row, "time/run_seconds": time.perf_counter() - t_fit})

    def log_rows(self, rows: list[dict[str, Any]], t_fit: float) -> None:
        """Log metrics rows in order (`log_row`)."""
        for row in rows:
            self.log_row(row, t_fit)

    def save_checkpoint(self) -> Path | None:
        """Atomic checkpoint of model (or adapter), optimizer, scheduler, RNG, data position and counters. Under
        FSDP2 every rank must call it; rank 0 writes and gets the path, the others None."""
        state = {"step": self.step, "batch": self.batch_number, "data": self.pipeline.state_dict(),
                 "weight_version": self.sync.version, "nonfinite_total": self.nonfinite_total}
        state["loss"] = self.loss_fn.state_dict()  # what the loss adapts as it trains (the entropy bonus's coefficient)
        save = self.checkpoints.save_distributed if self.dist is not None else self.checkpoints.save
        return save(self.step, self.model, self.tokenizer, self.optimizer, self.scheduler, state)

    # ------------------------------------------------------------------ one rollout batch, phase by phase
    def train_batch(self) -> tuple[list[dict[str, Any]], Optional[BaseException]]:
        """One rollout batch: fetch → (recompute pi_old) → per update: forward/backward → optimizer → then sync.
        Returns one metrics row per optimizer step (the first carries the batch's data metrics, the last the sync's)
        and the error of a sync that failed (a SIGTERM in it too), which the caller raises once the rows are written:
        the steps were trained."""
        t_start = time.perf_counter()
        batch = self.fetch_batch()
        t_data, waited_data = time.perf_counter(), self.evaluations.waited_total()
        head: dict[str, Any] = {**self.pipeline.metrics(), **batch.metrics}
        if batch.num_loss_tokens > 0:
            # pi_old's and the KL reference's forwards run on the rollout batch's micro-batches: the budget holds
            # for them too (the updates' plan re-splits these rows, carrying what those forwards stored).
            batch = self.bounded(batch)
        if self.loss_needs.recomputed_old_logprobs:
            self.recompute_old_logprobs(batch)
            head["time/old_logprobs_seconds"] = time.perf_counter() - t_data
        if self.reference is not None:
            t_ref = time.perf_counter()
            self.reference_logprobs(batch)
            head["time/ref_logprobs_seconds"] = time.perf_counter() - t_ref
        rows = []
        for epoch, mini in self.plan(batch):
            if self.step >= self.cfg.steps:
                break
            update = self.update(mini) if mini.num_loss_tokens > 0 else self.skip_update()
            rows.append({"step": self.step + 1, **update, "batch": float(self.batch_number + 1), "epoch": float(epoch)})
            self.step += 1
        self.batch_number += 1
        t_sync, waited_sync = time.perf_counter(), self.evaluations.waited_total()
        failed: Optional[BaseException] = None
        try:
            sync_metrics = self.maybe_sync()
        except BaseException as error:
            failed = error
            sync_metrics = {"sync/seconds": math.nan, "sync/version": float(self.sync.version)}
        t_end = time.perf_counter()
        # The wall clock's parts; an evaluation's generation waited on before the weights changed is eval_wait's.
        self.clock.add("generation_wait", t_data - t_start)
        self.clock.add("training", t_sync - t_data - (waited_sync - waited_data))
        self.clock.add("sync", t_end - t_sync - (self.evaluations.waited_total() - waited_sync))
        fill_batch_rows(rows, head, BatchTimes(t_start, t_data, t_sync, t_end), sync_metrics, self.sync.version,
                        self.sync.server.metrics, self.device)
        if math.isfinite(rows[0].get("reward/mean", math.nan)):  # a batch with no group has no reward
            self.rewards.append(float(rows[0]["reward/mean"]))
        return rows, failed

    def plan(self, batch: PreparedBatch) -> list[tuple[int, PreparedBatch]]:
        """(epoch, mini-batch) of each of the rollout batch's updates; a batch with nothing to train on (every group
        dropped by the batcher) is not split: each of its updates is skipped."""
        if batch.num_loss_tokens == 0:
            return [(epoch, batch) for epoch in range(self.cfg.ppo_epochs) for _ in range(self.cfg.mini_batches)]
        plan = update_plan(batch, self.cfg.ppo_epochs, self.cfg.mini_batches, self.cfg.seed, self.batch_number,
                           self.max_tokens, self.packed, self.shared)
        if self.skip_zero_advantage:
            # After the mini-batch split, so each update keeps its own normalisers and the gradients are unchanged.
            plan = [(epoch, without_zero_advantage_rows(mini, mini.micro_batch_size, self.max_tokens, self.packed,
                                                        self.shared))
                    for epoch, mini in plan]
        return plan if self.token_cap is None else [(epoch, self.bounded(mini)) for epoch, mini in plan]

    def bounded(self, batch: PreparedBatch) -> PreparedBatch:
        """`batch` in micro-batches within the explicit token budget, or with those over the derived cap re-split
        (`batch` itself when none is over); unchanged without either."""
        if self.max_tokens is not None:
            return token_budget_split(batch, self.max_tokens, self.packed, self.shared)
        if self.token_cap is not None:
            return capped_split(batch, self.token_cap, self.packed, self.shared)
        return batch

    def skip_update(self) -> dict[str, Any]:
        """The row of an optimizer step with no token to train on: no forward, no optimizer or schedule step; its
        loss is unknown (null), not 0, and `train/skipped_empty` marks it (the batch's `data/` keys say why)."""
        log.warning("step %d: the rollout batch has no token to train on (see its data/ metrics); step skipped",
                    self.step + 1)
        return {"loss": math.nan, "grad_norm": math.nan, "lr": self.scheduler.get_last_lr()[0],
                "train/skipped_nonfinite": float(self.nonfinite_total), "train/skipped_empty": 1.0,
                "time/step_seconds": 0.0, "tokens/trained": 0.0}

    def update(self, batch: PreparedBatch) -> dict[str, Any]:
        """One optimizer step on `batch` (a rollout batch or one of its mini-batches); its metrics."""
        t0 = time.perf_counter()
        try:
            loss_total, loss_metrics = self.forward_backward(batch)
        except torch.OutOfMemoryError as error:
            raise TrainerOutOfMemoryError(out_of_memory_advice(batch, self.step + 1, self.device, self.packed,
                                                               self.shared)) from error
        t_fwd = time.perf_counter()
        grad_norm = self.optimizer_step(loss_total)
        t_opt = time.perf_counter()
        self.adapt_loss(loss_metrics)
        return {
            **loss_metrics,
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "train/skipped_nonfinite": float(self.nonfinite_total),
            "train/skipped_empty": 0.0,
            "time/train_seconds": t_opt - t0,
            "time/forward_backward_seconds": t_fwd - t0,
            "time/step_seconds": t_opt - t0,
            "tokens/trained": float(batch.num_loss_tokens),
            # Rows of the update not forwarded (train.skip_zero_advantage: advantage 0 everywhere).
            "batch/rows_left_out": float(batch.num_sequences - sum(mb.num_sequences for mb in batch.micro_batches)),
            "throughput/trained_tokens_per_s": batch.num_loss_tokens / max(t_opt - t0, 1e-9),
            **self.perf(batch, t_opt - t0),
        }

    def adapt_loss(self, step_metrics: dict[str, float]) -> None:
        """A loss that steers itself by the step (the entropy bonus's coefficient, `loss.entropy_target`) gets the
        step's mean entropy, the same on every rank (the metrics are reduced); a skipped, non-finite step none."""
        entropy = step_metrics.get("grpo/entropy")
        if entropy is not None and math.isfinite(entropy):
            self.loss_fn.adapt(entropy)

    def perf(self, batch: PreparedBatch, seconds: float) -> dict[str, float]:
        """`batch/pad_fraction` and `tokens/forwarded` of the update's forward passes (the shared rows' under
        prefix sharing), and `perf/tflops` / `perf/mfu` of its model FLOPs
        (`grpo.trainer.flops`) over `seconds`, per device (the ranks share the FLOPs)."""
        recompute = bool(getattr(self.model, "is_gradient_checkpointing", False))
        return forward_perf(batch, seconds, packed=self.packed, shared=self.shared, flops=self.flops, peak=self.peak,
                            recompute=recompute, world_size=self.dist.world_size if self.dist else 1)

    @torch.no_grad()
    def batch_logprobs(self, batch: PreparedBatch, logprob_fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        """``logprob_fn``'s detached log-probs of each micro-batch of the rollout batch, in the trainer's layout, on
        the micro-batches' own device. Every FSDP2 rank computes all of them (the forwards are collectives)."""
        out = []
        for mb in batch.micro_batches:
            dev = mb.to(self.device)
            lp = logprob_fn(dev.input_ids, dev.attention_mask, dev.labels, dev.temperatures,
                            chunk_size=self.cfg.logprob_chunk, **self.layout)
            out.append(lp.detach().to(mb.labels.device))
        return out

    def recompute_old_logprobs(self, batch: PreparedBatch) -> None:
        """pi_old for every sequence of the rollout batch: the trainer's log-probs before its first update (stored on
        each micro-batch as `old_logprobs`)."""
        self.model.train()  # the mode of the updates, so the first update's ratio is exactly 1
        for mb, lp in zip(batch.micro_batches, self.batch_logprobs(batch, self.token_logprobs)):
            mb.old_logprobs = lp

    def reference_logprobs(self, batch: PreparedBatch) -> None:
        """The KL penalty's reference log-probs for every sequence of the rollout batch, from the frozen initial
        policy (stored on each micro-batch as `ref_logprobs`, in place of any an environment sent)."""
        assert self.reference is not None
        for mb, lp in zip(batch.micro_batches, self.batch_logprobs(batch, self.reference.logprobs)):
            mb.ref_logprobs = lp

    def fetch_batch(self) -> PreparedBatch:
        """The next rollout batch (the data source is indexed by rollout batch, 0-based). A server that died while generating is restarted by the server (bounded by
        server.max_restarts; it raises when they are used up) and the step's generation runs again once."""
        faults.point("generate", self.step + 1)
        return retried_after_recovery(lambda: self.pipeline.next_batch(self.batch_number),
                                      lambda error: self.sync.server.recover(error))

    def forward_backward(self, batch: PreparedBatch) -> tuple[float, dict[str, float]]:
        """Gradients of the step's loss, accumulated over its micro-batches; (summed loss, token-weighted
        metrics). Under FSDP2 each rank runs its share, zero-weighted repeats keep the ranks' collectives in step."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_total = 0.0
        micro_batches, scale = [(mb, 1.0) for mb in batch.micro_batches], 1.0
        forwarded_loss_tokens = sum(float(mb.loss_mask.sum()) for mb in batch.micro_batches)
        if self.dist is not None:
            mine, pad = fsdp.rank_share(batch.micro_batches, self.dist.rank, self.dist.world_size)
            micro_batches = [(mb, 1.0) for mb in mine] + [(batch.micro_batches[0], 0.0)] * pad
            scale = fsdp.loss_scale(self.dist.world_size)
        for mb, weight in micro_batches:
            mb = mb.to(self.device)
            loss, m = self.micro_batch_loss(mb, batch)
            if faults.active("nan_loss", self.step + 1):
                loss = loss * float("nan")
            if weight == 0.0:
                (loss * 0.0).backward()
                # The same metric keys as the ranks that trained (their sums are reduced together), adding nothing.
                for k in m:
                    sums.setdefault(k, 0.0)
                continue
            (loss * scale if scale != 1.0 else loss).backward()
            loss_total += float(loss.detach())
            # Token-weighted average of the micro-batch metrics over the tokens forwarded (all of the step's loss
            # tokens unless train.skip_zero_advantage left rows out).
            w = float(mb.loss_mask.sum()) / max(forwarded_loss_tokens, 1)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + w * float(v)
        if self.dist is not None:
            reduced = fsdp.all_reduce_sum({**sums, "__loss": loss_total}, self.dist.device)
            loss_total = reduced.pop("__loss")
            sums = reduced
        return loss_total, sums

    def micro_batch_loss(self, mb: TrainBatch, batch: PreparedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of one micro-batch (normalised by the whole step's counts) and its metrics."""
        # pi_old when the trainer recomputed it (loss.old_logprobs=recompute), else None; the step's normalisers.
        totals = Totals(batch.num_loss_tokens, batch.num_sequences, batch.max_completion_tokens)

        def loss_of(
            logprobs: torch.Tensor, with_metrics: bool = True, entropy: Optional[torch.Tensor] = None
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            inputs = LossInputs(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask,
                                ref_logprobs=mb.ref_logprobs, old_logprobs=mb.old_logprobs,
                                entropy=entropy if self.loss_needs.entropy else None, totals=totals)
            return self.loss_fn(inputs, with_metrics=with_metrics)

        # Receives the entropies: for grpo/entropy, and with their gradient for an entropy bonus.
        stats: Optional[dict[str, torch.Tensor]] = {} if self.entropy_metric or self.loss_needs.entropy else None
        grad_kw = {"entropy_grad": True} if self.loss_needs.entropy else {}  # a custom logprob_fn may predate it
        if self.fused:
            loss, m, _ = fused_token_loss(
                self.model, mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures, loss_of,
                chunk_size=self.cfg.logprob_chunk, separable=self.loss_needs.token_separable, stats=stats,
                **grad_kw, **self.layout,
            )
        else:
            logprobs = self.token_logprobs(
                mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures, chunk_size=self.cfg.logprob_chunk,
                stats=stats, **grad_kw, **self.layout,
            )
            loss, m = loss_of(logprobs, entropy=stats["entropy"] if stats is not None else None)
        if stats is not None:
            # The policy's mean per-token entropy over the loss tokens (nats, at the sampling temperature): a
            # collapse towards 0 shows the policy turning deterministic, exploration gone.
            m["grpo/entropy"] = float((stats["entropy"].detach() * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1))
        return loss, m

    def optimizer_step(self, loss_total: float) -> float:
        """Clip, then step the optimizer and the schedule when loss and gradient are finite; a non-finite step is
        skipped and counted (raises after train.max_nonfinite_steps in a row). Returns the gradient norm."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm) if self.params else 0.0
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if math.isfinite(loss_total) and math.isfinite(grad_norm):
            self.nonfinite_in_a_row = 0
            if self.sync.serves_weights_in_place:  # the step changes what the server samples: an eval must be done
                self.evaluations.settle()
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
        """Push the weights to the server every `mode.sync_every` rollout batches (after the batch's last update)
        and after the last step. With the batch's generation stall (`sync/gen_stall_seconds`: the server could not
        generate because of weight updates, shared_vllm's optimizer-step pauses included; `sync/drain_seconds`)."""
        if self.batch_number % self.sync.sync_every == 0 or self.step == self.cfg.steps:
            self.evaluations.settle()  # an evaluation beside training generates on the weights this sync replaces
            # A server that died during the sync is restarted on the weights it served (bounded by
            # server.max_restarts) and the sync runs again once, as for generation. Not under torchrun: the
            # sync's gather is a collective the other ranks joined once.
            out = retried_after_recovery(
                lambda: self.sync.sync(self.model, self.step),
                lambda error: self.dist is None and self.sync.server.recover(error),
                lambda error: log.warning("step %d: the weight sync failed (%s); the server was restarted, syncing "
                                          "again", self.step, error))
            out |= self.sync.check_arrival(self.model)
        else:
            out = {"sync/seconds": 0.0, "sync/version": float(self.sync.version)}
        return {**out, **self.sync.take_generation_stall()}

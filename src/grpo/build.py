"""A run's components built from its config, node by node, and wired to the trainer (see docs/architecture.md).

`build_parts` builds what needs no server (processes, model dir, sync strategy, loss, data source, evaluator) and
the run's server session (grpo.serving.session: the server's lifecycle, serving the sync strategy's weights), then
starts the server's processes without waiting for them (`server.launch_early`) and loads the tokenizer while vLLM
starts; `build_trainer` waits for the server (launches it, with `server.launch_early=false`) and builds the model,
optimizer, metrics and the trainer, restoring a checkpoint; `RunParts.close` tears everything down in reverse order,
also between the jobs of a sweep (whose server may be kept for the next job: grpo.serving.kept).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from grpo.algorithms.overlong import TruncationRule
from grpo.config.run_dir import check_ranks_see_run_files
from grpo.config.validate import check_optimizer_settings
from grpo.config_values import ConfigError, instantiation_cause
from grpo.inference import preload
from grpo.models.loading import load_tokenizer, pick_device
from grpo.pipeline.base import BatchShape, DataPipeline, PipelineContext
from grpo.pipeline.evaluation import EvalContext, Evaluator, build_evaluator
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.rank_broadcast import FollowerPipeline, LeaderPipeline
from grpo.pipeline.rollout_queue import AsyncRollouts
from grpo.recipes.initial_weights import resolve_model_dir
from grpo.recipes.trainable_model import build_model, build_reference_policy
from grpo.run_records import release_device_memory
from grpo.run_summary import check_objective
from grpo.schema import ServerConfig
from grpo.serving.checks import check_server_fits_model
from grpo.serving.session import ServerSession
from grpo.sync.base import SyncContext, SyncStrategy
from grpo.sync.follower import FollowerSync
from grpo.trainer import fsdp
from grpo.trainer.checkpoint import CheckpointManager, read_trainer_state
from grpo.trainer.fsdp import DistInfo
from grpo.trainer.loop import GRPOTrainer
from grpo.trainer.loss_interface import PolicyLoss
from grpo.trainer.metrics import MetricsLogger, NullMetrics
from grpo.trainer.minibatch import rollout_batches, updates_per_batch
from grpo.trainer.optim import build_optimizer, build_scheduler
from grpo.trainer.wall_clock import WallClock

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    """What a run builds from its config, in the order built. Under torchrun only rank 0 has a data source and an
    evaluator; `trainer` and `metrics` exist once `build_trainer` ran."""

    cfg: DictConfig
    run_dir: Path
    dist: DistInfo | None
    device: torch.device
    model_dir: str
    tokenizer: Any
    resume: Path | None  # the checkpoint this run resumes from
    sync: SyncStrategy
    # The run the sync serves, what its server launches with.
    sync_ctx: SyncContext
    # The run's server, serving the sync's weights (it may be starting already: `server_started_early`).
    server: ServerSession
    loss_fn: PolicyLoss
    data: DataPipeline | None
    evaluator: Evaluator | None
    # How the data source and the evaluator sample the policy (rank 0; grpo.pipeline.generation).
    generation: GenerationHandle | None = None
    trainer: GRPOTrainer | None = None
    metrics: MetricsLogger | NullMetrics | None = None
    # A sweep's job whose server may be taken from the job before and kept for the next (server.reuse_across_jobs).
    reuse_server: bool = False
    # Where the job's wall clock goes (the server's start and the model's load are timed here).
    clock: WallClock | None = None
    # Whether the server's processes were started in build_parts (server.launch_early), not by build_trainer.
    server_started_early: bool = False

    @property
    def rank0(self) -> bool:
        return self.dist is None or self.dist.is_rank0

    def close(self, failed: BaseException | None = None, completed: bool = False) -> None:
        """Tear down in reverse order so a multirun's next job starts from a clean process table and memory. The
        trainer lets go of its model, gradients and optimizer state first, even when a traceback still holds it, and
        before the server stops: under shared_vllm the parameters are views of the server's memory. Each part is
        closed even when one before it raises: the server this run started is always stopped.

        `failed`: the error the run is ending with. A teardown error after it (a run dir turned read-only fails the
        run and then its teardown too) is secondary: logged as such and noted on `failed`, never raised in its place.
        Without one, the first teardown error is raised once every part is closed. The server is kept for the next
        job when the run `completed` as a sweep's job that keeps it (`reuse_server`, grpo.serving.kept)."""
        steps = [part.close for part in (self.metrics, self.evaluator, self.data, self.generation, self.trainer)
                 if part is not None]
        keep = completed and self.reuse_server and self.sync.reuses_server
        steps += [release_device_memory, lambda: self.server.shutdown(keep=keep)] + ([fsdp.destroy] if self.dist is not None else [])
        self.trainer = None  # `steps` holds trainer.close until it runs, then nothing keeps the trainer
        errors: list[Exception] = []
        while steps:
            step = steps.pop(0)
            try:
                step()
            except Exception as e:  # noqa: BLE001 - every part is closed; the errors are reported below
                errors.append(e)
                if failed is not None:
                    log.error("while tearing down after %s: %s: %s (secondary: the run's error is the %s)",
                              type(failed).__name__, type(e).__name__, e, type(failed).__name__)
                    failed.add_note(f"(teardown afterwards also failed: {type(e).__name__}: {e})")
            del step  # a bound trainer.close must not keep the trainer alive through the later steps
        if failed is None and errors:
            for later in errors[1:]:
                log.error("teardown also failed: %s: %s", type(later).__name__, later)
            raise errors[0]


def build_parts(cfg: DictConfig, run_dir: Path, reuse_server: bool = False,
                clock: WallClock | None = None) -> RunParts:
    """Everything that needs no server, each part checked as it is built (a data source that does not answer, bad
    held-out prompts) so that a mistake stops the run before vLLM starts; then, with `server.launch_early`, the
    server's processes start (build_trainer waits for them), and the optimizer's settings are checked and the
    tokenizer loads while vLLM starts. `reuse_server`:
    a sweep's job that takes the server the job before kept and keeps its own for the next (grpo.serving.kept)."""
    torch.manual_seed(cfg.train.seed)
    loss_fn = build_loss(cfg)  # first: a bad loss setting stops the run before processes, warm start or server
    log.info("loss %s", loss_fn)
    if cfg.train.torch_threads is not None:
        torch.set_num_threads(int(cfg.train.torch_threads))
    # Said always: a parallel sweep's jobs share the host's cores (OMP_NUM_THREADS from its launcher).
    log.info("trainer torch threads: %d", torch.get_num_threads())
    dist_info, device = start_processes(cfg)
    rank0 = dist_info is None or dist_info.is_rank0
    model_dir = model_directory(cfg, dist_info)
    if dist_info is not None:
        check_ranks_see_run_files(run_dir, model_dir)
    check_server_fits_model(cfg, model_dir)  # before vLLM spends its start-up finding out
    log.info("run %s | run dir %s | model %s | device %s", cfg.name, run_dir, model_dir, device)
    resume_ckpt = resume_checkpoint(cfg)
    sync = build_sync(cfg, rank0, resume_ckpt)
    data = build_data(cfg) if rank0 else None
    log.info("data pipeline %s", type(data).__name__ if data is not None else "rank 0's")
    if data is not None:
        data.preflight()  # a remote source that does not answer stops the run before the server starts
    try:
        evaluator = build_evaluator(cfg.eval, cfg.data) if rank0 else None  # bad eval input fails before a model loads
    except ValueError as e:  # each of its messages names the eval/data key to change
        raise ConfigError(str(e)) from None
    check_objective(cfg.train.objective, evaluator is not None, type(evaluator).metric_names if evaluator else ())
    sync_ctx = SyncContext(run_dir=run_dir, model_dir=Path(model_dir), server_cfg=cfg.server, lora_cfg=cfg.lora,
                           resume_weights=resume_ckpt, reuse_server=reuse_server)
    clock = clock if clock is not None else WallClock()
    server = ServerSession(sync, sync_ctx)
    early = start_server_early(cfg, server, rank0, clock)
    try:
        check_optimizer_settings(cfg)  # torch._dynamo's import, while vLLM starts
        sync_ctx.tokenizer = load_tokenizer(model_dir)  # transformers' import and the tokenizer, while vLLM starts
    except BaseException:
        server.shutdown()  # the server started early stops with the run
        raise
    clock.mark("parts_built")
    return RunParts(cfg=cfg, run_dir=run_dir, dist=dist_info, device=device, model_dir=model_dir,
                    tokenizer=sync_ctx.tokenizer, resume=resume_ckpt, sync=sync, sync_ctx=sync_ctx, server=server,
                    loss_fn=loss_fn, data=data, evaluator=evaluator,
                    generation=generation_handle(server) if rank0 else None, reuse_server=reuse_server, clock=clock,
                    server_started_early=early)


def start_server_early(cfg: DictConfig, server: ServerSession, rank0: bool, clock: WallClock) -> bool:
    """With `server.launch_early` (rank 0): start the server's processes now, without waiting for them; True when
    started (the wall clock notes the moment: summary.json's `startup_at.server_launched_seconds`)."""
    if not (rank0 and cfg.server.get("launch_early", ServerConfig.launch_early)):
        return False
    started = server.start_early()
    if started:
        clock.mark("server_launched")
    else:  # servers started elsewhere, or a sweep's kept one: the command's preloaded server is not needed
        preload.discard()
    return started


def build_loss(cfg: DictConfig) -> PolicyLoss:
    """The run's loss, built once from its `loss` node (`GRPOLoss` for every shipped option). The loss checks its
    own settings when built: a bad value (a clip-eps sweep's `loss.clip_eps=-0.1`) is a ConfigError naming it."""
    try:
        loss_fn = instantiate(cfg.loss)
    except InstantiationException as e:
        cause = instantiation_cause(e)
        if not isinstance(cause, (ValueError, TypeError)):
            raise
        # A cause that already says what to set stands alone; otherwise point at the keys it names.
        fix = "" if re.search(r"\bset loss\.\w+", str(cause)) else "; set the loss.* key it names"
        raise ConfigError(f"loss ({cfg.loss._target_}): {cause}{fix}") from None
    if not isinstance(loss_fn, PolicyLoss):
        raise ConfigError(f"loss._target_={cfg.loss._target_} builds a {type(loss_fn).__name__}, which is no "
                          "grpo.trainer.loss_interface.PolicyLoss (the trainer reads what a loss needs from it); "
                          "subclass PolicyLoss, or name a loss.objective of grpo.trainer.loss.GRPOLoss")
    return loss_fn


def build_data(cfg: DictConfig) -> DataPipeline:
    """The run's data pipeline (rank 0); with `train.max_staleness >= 1` a local one is wrapped in the asynchronous
    producer (grpo.pipeline.rollout_queue). k = 0 never builds the producer: the synchronous loop, unchanged. A
    source that generates on its own (Atropos) is not wrapped: it gets k through PipelineContext.max_staleness."""
    try:
        data = instantiate(cfg.data, _recursive_=False)
    except InstantiationException as e:  # the pipeline checks its own settings; each message names the data key
        cause = instantiation_cause(e)
        if not isinstance(cause, ValueError):
            raise
        raise ConfigError(str(cause)) from None
    if cfg.train.max_staleness > 0 and not data.asynchronous_source:
        data = AsyncRollouts(data, cfg.train.max_staleness, str(cfg.train.stale_policy), cfg.train.rollout_queue,
                             cfg.train.rollout_batches_in_flight)
        log.info("asynchronous rollouts: %r", data)
    return data


def start_processes(cfg: DictConfig) -> tuple[DistInfo | None, torch.device]:
    """Under torchrun, join the process group (FSDP2 across the ranks); returns (DistInfo or None, device)."""
    if fsdp.world_size() <= 1:
        return None, pick_device(cfg.train.device)
    dist_info = fsdp.init_from_env(cfg.train.device)
    return dist_info, dist_info.device


def model_directory(cfg: DictConfig, dist_info: DistInfo | None) -> str:
    """The HF directory (or hub id) of the initial weights (an offline preset is built here). Under torchrun rank 0
    resolves it and every rank uses the one rank 0 names: a rank on another node never builds a preset of its own,
    which `check_ranks_see_run_files` then requires it to see."""
    if dist_info is None:
        return resolve_model_dir(cfg.model)
    return fsdp.rank0_result(lambda: resolve_model_dir(cfg.model))


def resume_checkpoint(cfg: DictConfig) -> Path | None:
    """The latest complete checkpoint of `train.resume`'s run dir, or None for a fresh run."""
    if not cfg.train.resume:
        return None
    ckpt = CheckpointManager(Path(cfg.train.resume), keep=cfg.train.keep_checkpoints).latest()
    if ckpt is None:
        raise FileNotFoundError(f"train.resume={cfg.train.resume} has no complete checkpoint under checkpoints/")
    return ckpt


def build_sync(cfg: DictConfig, rank0: bool, resume_ckpt: Path | None) -> SyncStrategy:
    """The run's sync strategy; torchrun ranks > 0 get a follower that joins the gathers rank 0's strategy runs."""
    mode = get_class(cfg.mode._target_)
    sync = instantiate(cfg.mode) if rank0 else FollowerSync(cfg.mode.sync_every, gather=mode.fsdp_gather,
                                                            uses_lora=mode.uses_lora)
    if resume_ckpt is not None:
        # The server reports the resumed weights' version from its first answer on.
        sync.version = int(read_trainer_state(resume_ckpt).get("weight_version", 0))
    log.info("sync strategy %s (every %d steps)", type(sync).__name__, sync.sync_every)
    return sync


def generation_handle(server: ServerSession) -> GenerationHandle:
    """The run's one way to sample the policy, for the data source and the evaluator: the endpoint the server session
    serves (replicas, model or adapter name, version; read anew for every call) through its gate."""
    return GenerationHandle(server.endpoint, server.gate)


def build_trainer(parts: RunParts) -> GRPOTrainer:
    """Set up the evaluator and start the data's reward workers, wait for the server started early (or launch it),
    build model, optimizer and metrics, restore a checkpoint, set up the data source on the server; the trainer (also
    kept in `parts`, with the metrics, for `close`). The trainer's model loads once vLLM has started: on a GPU they share, vLLM sizes its KV cache from
    the memory free while it starts."""
    cfg, sync, data, tokenizer, run_dir = parts.cfg, parts.sync, parts.data, parts.tokenizer, parts.run_dir
    sync_ctx = parts.sync_ctx
    clock = parts.clock if parts.clock is not None else WallClock()
    setup_evaluator(parts)  # while the server starts
    if data is not None:
        data.start_workers()  # reward workers spawn while the server starts, not after the model's load
    t0, launch_at = time.perf_counter(), time.time()
    parts.server.launch()  # waits for a server started early
    preload.discard()  # a run that launched no server of its own lets the command's preloaded one go
    t_launched = time.perf_counter()
    # Started early, the server started beside the tokenizer's load: what is left is the wait for it.
    clock.add_startup("server_wait" if parts.server_started_early else "server_start", t_launched - t0)
    if parts.server.started_here:
        clock.mark("server_launched", at=launch_at)  # the early start's own mark stays
        clock.mark("server_ready")
    model = build_model(cfg, sync, sync_ctx, parts.resume, parts.device, parts.dist)
    reference = build_reference_policy(cfg, parts.loss_fn, sync, sync_ctx, model, parts.device, parts.dist)
    clock.add_startup("model_load", time.perf_counter() - t_launched)
    clock.mark("model_loaded")
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.train.lr_schedule, cfg.train.warmup_steps, cfg.train.steps)
    clock.mark("optimizer_built")
    log.info("optimizer %s lr %g", type(optimizer).__name__, cfg.optimizer.lr)
    source = data if parts.dist is None else (LeaderPipeline(data) if data is not None else FollowerPipeline())
    checkpoints = CheckpointManager(run_dir, keep=cfg.train.keep_checkpoints)
    start_step, start_batch, loss_state = 0, None, None
    if parts.resume is not None:
        # FSDP2: rank 0 reads the checkpoint and broadcasts it into every rank's shards.
        load = checkpoints.load_distributed if parts.dist is not None else checkpoints.load
        state = load(parts.resume, model, optimizer, scheduler)
        start_step, start_batch = int(state["step"]), state.get("batch")
        source.load_state_dict(state.get("data", {}))
        loss_state = state.get("loss")  # what the loss had adapted to (loss.entropy_target's coefficient)
        log.info("resumed from %s at step %d", parts.resume, start_step)
    first_batch, total_batches = rollout_batches(cfg.train, start_step, start_batch)
    if data is not None:
        data.setup(pipeline_context(cfg, tokenizer, parts.generation, model, run_dir, first_batch, total_batches))
    clock.mark("data_ready")
    # A resumed run's metrics.jsonl starts with the earlier rows up to the checkpoint (from the resumed run dir when
    # this one is another), so metrics, curves.png and grpo.report show the whole run.
    parts.metrics = MetricsLogger(run_dir, cfg.logging, cfg, cfg.train.steps, start_step,
                                  resumed_from=Path(cfg.train.resume) if parts.resume is not None else None,
                                  name=cfg.name) if data is not None else NullMetrics()
    parts.trainer = GRPOTrainer(
        train_cfg=cfg.train, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
        loss_fn=parts.loss_fn, pipeline=source, sync=sync, checkpoints=checkpoints, metrics=parts.metrics,
        device=parts.device, start_step=start_step, start_batch=start_batch, loss_state=loss_state, reference=reference,
        dist=parts.dist,
        evaluator=parts.evaluator, clock=clock,
        logprob_fn=fsdp.sharded_token_logprobs(model) if parts.dist is not None else None,
    )
    return parts.trainer


def setup_evaluator(parts: RunParts) -> None:
    """The evaluator's setup (held-out prompts tokenized, grading workers started): it samples the rollouts' server
    (the endpoint follows restarts and syncs) with seeds and sampling of its own."""
    if parts.evaluator is None:
        return
    cfg = parts.cfg
    parts.evaluator.setup(EvalContext(tokenizer=parts.tokenizer, generation=parts.generation, run_dir=parts.run_dir,
                                      seed=cfg.train.seed, total_steps=cfg.train.steps,
                                      max_seq_len=cfg.model.max_seq_len,
                                      updates_per_batch=updates_per_batch(cfg.train)))


def pipeline_context(cfg: DictConfig, tokenizer: Any, generation: GenerationHandle, model: torch.nn.Module,
                     run_dir: Path, first_batch: int, total_batches: int) -> PipelineContext:
    """What the data source learns at setup: how to sample the policy, the loop's batch and its shape, the rollout
    batches to produce (from `first_batch` of `total_batches`), where and how often the run saves."""
    return PipelineContext(
        tokenizer=tokenizer, generation=generation, batch_size=cfg.train.micro_batch_size * cfg.train.grad_accum,
        max_seq_len=cfg.model.max_seq_len, run_dir=run_dir, total_steps=total_batches, start_step=first_batch,
        checkpoint_every=cfg.train.checkpoint_every, seed=cfg.train.seed, max_staleness=cfg.train.max_staleness,
        batch_shape=BatchShape(
            micro_batch_size=cfg.train.micro_batch_size, max_seq_len=cfg.model.max_seq_len,
            pad_token_id=tokenizer.pad_token_id, vocab_size=model.get_input_embeddings().num_embeddings,
            advantage_norm=cfg.train.advantage_norm,
            # From the config, not the loss object: a loss class of one's own needs no `truncation` attribute.
            truncation=TruncationRule(cfg.loss.mask_truncated, cfg.loss.overlong_buffer,
                                      cfg.loss.overlong_penalty_factor),
        ),
    )

"""Train a language model with GRPO against a vLLM server.

    python train.py                                   # the default job: warm-started tiny model, arithmetic, CPU vLLM
    python train.py '~experiment'                     # the bare config: random tiny model, digits task
    python train.py mode=lora_only model=qwen3b server=gpu
    python train.py experiment=qwen3b_lora_restart
    python train.py -m loss.clip_eps=0.1,0.2 optimizer.lr=1e-4,1e-3

Each component is built here from its config node and handed to the trainer; see docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from grpo.config import ConfigError, register_configs, validate
from grpo.config.validate import check_server_fits_model
from grpo.options import instantiation_cause
from grpo.pipeline.base import DataSourceError
from grpo.run import (
    RunSummary,
    check_objective,
    check_resume_identity,
    device_memory,
    discard_unstarted_run_dir,
    done_message,
    objective_value,
    record_device_memory,
    record_provenance,
    release_device_memory,
)

register_configs()
log = logging.getLogger("train")


def _sigterm_as_interrupt(signum, frame):  # noqa: ARG001
    # SIGTERM takes the same clean path as Ctrl-C: stop the server, keep the last complete checkpoint.
    raise KeyboardInterrupt(f"signal {signum}")


def config_error(error: Exception, multirun: bool, run_dir: Path | None = None) -> float:
    """A config mistake (ConfigError) or a data source that does not answer (DataSourceError) is the user's to fix:
    print its message, not a traceback, and exit 1; in a sweep, skip the job (NaN objective, status `skipped` in its
    summary.json for grpo.report) and go on."""
    if multirun:
        log.error("%s: %s (this job is skipped; the sweep goes on)", type(error).__name__, error)
        if run_dir is not None:
            RunSummary(run_dir).skip(error)
        return float("nan")
    if run_dir is not None:
        discard_unstarted_run_dir(run_dir)  # created for a run that never started
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    raise SystemExit(1) from None


def server_start_failed(error: BaseException) -> bool:
    """The vLLM server could not start (port taken, a bad argument, a start-up timeout): the message names the
    cause and the log, the vLLM log's tail is logged; a Python traceback of the launch adds 40 frames to that."""
    from grpo.inference.process import ServerStartError

    return isinstance(error, ServerStartError)


def has_trained(run_dir: Path) -> bool:
    """metrics.jsonl has a row of a trained step (not only the step-0 eval); False when it cannot be read."""
    from grpo.stop import last_step
    from grpo.trainer.metrics import MetricsFileError

    try:
        return bool(last_step(run_dir))
    except MetricsFileError:  # said by the stop report; here it must not replace the error being handled
        return False


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Returns `train.objective` (default: the mean reward of the last 10 rollout batches), which sweeps optimise."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    rank0 = int(os.environ.get("RANK", "0")) == 0  # torchrun: rank 0 owns the run dir and every output
    try:
        validate(cfg, run_dir if rank0 else None)  # everything checkable before a model loads
        check_resume_identity(cfg)  # before record_provenance rewrites a resumed run's own record
    except ConfigError as e:
        return config_error(e, multirun, run_dir if rank0 else None)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    if rank0:
        record_provenance(run_dir, cfg)
    summary = RunSummary(run_dir) if rank0 else None
    # One process training on a GPU: its device memory at the start, checked against the end (device_memory.json).
    single_gpu = rank0 and int(os.environ.get("WORLD_SIZE", "1")) == 1 and cfg.train.device != "cpu"
    memory_before = device_memory() if single_gpu else None
    try:
        rewards = train(cfg, run_dir)
        final = summary.finish(rewards) if summary is not None else None
        if summary is not None:
            log.info(done_message(run_dir))
    except BaseException as e:
        # A data source that stops answering after steps were trained (run-api killed mid-run) is the run's failure,
        # not a config problem: a sweep records that job as failed, not skipped.
        config_problem = isinstance(e, ConfigError) or (
            isinstance(e, DataSourceError) and not (rank0 and has_trained(run_dir)))
        # A config problem is no failed run: a sweep's job is skipped, a single run's dir removed (config_error);
        # a summary.json of `failed` would also replace the one of a run resumed in place.
        if summary is not None and not config_problem:
            summary.fail(e)
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C / SIGTERM: a short block (grpo.stop), not a traceback
            from grpo.stop import exit_code, report_stop

            if rank0:
                report_stop(e, cfg, run_dir, HydraConfig.get().overrides.task)
            raise SystemExit(exit_code(e)) from None
        # Found while building a component (the evaluator's held-out prompts, a data source that does not answer).
        if config_problem:
            return config_error(e, multirun, run_dir if rank0 else None)
        if not multirun and server_start_failed(e):  # its message (and the log tail logged) says it all
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        # A failed multirun job is logged and the sweep goes on with the next one.
        if multirun and not isinstance(e, KeyboardInterrupt):
            log.exception("job failed; continuing the sweep")
            return float("nan")  # sweepers (Optuna) record a NaN objective as a failed trial
        raise
    finally:
        # Here the job's exception (whose frames hold the model, its gradients and activations) is gone: release
        # what it kept, so a multirun's next job starts from the device memory this one started from.
        release_device_memory()
        if rank0 and memory_before is not None:
            record_device_memory(run_dir, memory_before)
    if summary is None:
        return None
    try:  # the run completed (summary.json says so) whatever the objective's fate
        return objective_value(run_dir, cfg.train.objective, final)
    except ConfigError as e:
        return config_error(e, multirun)


def train(cfg: DictConfig, run_dir: Path) -> list[float]:
    """Build every component from the config, train, and tear everything down (also between multirun jobs)."""
    from grpo.models.loading import load_tokenizer
    from grpo.pipeline.evaluation import build_evaluator
    from grpo.trainer.metrics import plot_curves

    torch.manual_seed(cfg.train.seed)
    if cfg.train.torch_threads is not None:
        torch.set_num_threads(int(cfg.train.torch_threads))
        log.info("trainer torch threads: %d", torch.get_num_threads())
    dist_info, device = start_processes(cfg)
    rank0 = dist_info is None or dist_info.is_rank0
    model_dir = model_directory(cfg, dist_info)
    check_server_fits_model(cfg, model_dir)  # before vLLM spends its start-up finding out
    tokenizer = load_tokenizer(model_dir)
    log.info("run %s | run dir %s | model %s | device %s", cfg.name, run_dir, model_dir, device)
    resume_ckpt = resume_checkpoint(cfg)
    sync = build_sync(cfg, rank0, resume_ckpt)
    loss_fn = instantiate(cfg.loss)
    log.info("loss %s", loss_fn)
    data = build_data(cfg) if rank0 else None
    log.info("data pipeline %s", type(data).__name__ if data is not None else "rank 0's")
    if data is not None:
        data.preflight()  # a remote source that does not answer stops the run before the server starts
    try:
        evaluator = build_evaluator(cfg.eval, cfg.data) if rank0 else None  # bad eval input fails before a model loads
    except ValueError as e:  # each of its messages names the eval/data key to change
        raise ConfigError(str(e)) from None
    check_objective(cfg.train.objective, evaluator is not None, type(evaluator).metric_names if evaluator else ())
    trainer = metrics = None
    try:
        trainer, metrics = build_trainer(cfg, run_dir, model_dir, tokenizer, sync, loss_fn, data, evaluator,
                                         resume_ckpt, device, dist_info)
        rewards = trainer.fit()
        if cfg.logging.plot and rank0:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", title=str(run_dir.name))
        return rewards
    finally:
        # Tear down in reverse order so a multirun's next job starts from a clean process table and memory. The
        # trainer lets go of its model, gradients and optimizer state first, even when a traceback still holds it,
        # and before the server stops: under shared_vllm the parameters are views of the server's memory.
        # Each part is closed even when one before it raises: the server this run started is always stopped.
        with contextlib.ExitStack() as teardown:
            if dist_info is not None:
                from grpo.trainer import distributed

                teardown.callback(distributed.destroy)
            teardown.callback(sync.shutdown)
            teardown.callback(release_device_memory)
            for part in (trainer, data, evaluator, metrics):  # run last to first: metrics.close() first
                if part is not None:
                    teardown.callback(part.close)
            del trainer  # the stack holds trainer.close until it runs, then nothing keeps the trainer


def build_data(cfg: DictConfig):
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
        from grpo.pipeline.rollout_queue import AsyncRollouts

        data = AsyncRollouts(data, cfg.train.max_staleness, str(cfg.train.stale_policy), cfg.train.rollout_queue,
                             cfg.train.rollout_batches_in_flight)
        log.info("asynchronous rollouts: %r", data)
    return data


def start_processes(cfg: DictConfig):
    """Under torchrun, join the process group (FSDP2 across the ranks); returns (DistInfo or None, device)."""
    from grpo.models.loading import pick_device
    from grpo.trainer import distributed

    if distributed.world_size() <= 1:
        return None, pick_device(cfg.train.device)
    dist_info = distributed.init_from_env(cfg.train.device)
    return dist_info, dist_info.device


def model_directory(cfg: DictConfig, dist_info) -> str:
    """The HF directory of the initial weights (an offline preset is built here); under torchrun rank 0 builds it
    while the other ranks wait."""
    import torch.distributed as tdist

    from grpo.recipes.initial_weights import resolve_model_dir

    if dist_info is not None and not dist_info.is_rank0:
        tdist.barrier()
    model_dir = resolve_model_dir(cfg.model)
    if dist_info is not None and dist_info.is_rank0:
        tdist.barrier()
    return model_dir


def resume_checkpoint(cfg: DictConfig) -> Path | None:
    """The latest complete checkpoint of `train.resume`'s run dir, or None for a fresh run."""
    from grpo.trainer.checkpoint import CheckpointManager

    if not cfg.train.resume:
        return None
    ckpt = CheckpointManager(Path(cfg.train.resume), keep=cfg.train.keep_checkpoints).latest()
    if ckpt is None:
        raise FileNotFoundError(f"train.resume={cfg.train.resume} has no complete checkpoint under checkpoints/")
    return ckpt


def build_sync(cfg: DictConfig, rank0: bool, resume_ckpt: Path | None):
    """The run's sync strategy; torchrun ranks > 0 get a follower that joins the gathers rank 0's strategy runs."""
    from grpo.sync.follower import FollowerSync
    from grpo.trainer.checkpoint import read_trainer_state

    sync = instantiate(cfg.mode) if rank0 else FollowerSync(
        cfg.mode.sync_every, gather=get_class(cfg.mode._target_).fsdp_gather)
    if resume_ckpt is not None:
        # The server reports the resumed weights' version from its first answer on.
        sync.version = int(read_trainer_state(resume_ckpt).get("weight_version", 0))
    log.info("sync strategy %s (every %d steps)", type(sync).__name__, sync.sync_every)
    return sync


def build_model(cfg: DictConfig, sync, sync_ctx, resume_ckpt: Path | None, device, dist_info) -> torch.nn.Module:
    """The trainable model: the strategy's own (shared_vllm) or loaded, with LoRA or frozen layers, sharded under
    torchrun."""
    from grpo.models.loading import compile_decoder_layers, load_model, pick_dtype, prepare_for_training, set_attention
    from grpo.trainer import distributed
    from grpo.trainer.layers import apply_lora, freeze_to_layers, resolve_layer_indices

    model = sync.load_model(sync_ctx)
    if model is None:
        base = sync_ctx.model_dir if (resume_ckpt is None or sync.uses_lora) else resume_ckpt
        model = load_model(str(base), pick_dtype(cfg.model.dtype, device), device, cfg.model.gradient_checkpointing)
    else:  # the strategy's own model (shared_vllm's views of vLLM's tensors) gets the same training set-up
        model = prepare_for_training(model, cfg.model.gradient_checkpointing)
    set_attention(model, cfg.model.attn_implementation)
    check_prefix_sharing_model(cfg, model)
    if cfg.train.padding_free and device.type == "cuda" and cfg.model.attn_implementation in (None, "sdpa", "eager"):
        # Measured on an H100 (docs/performance.md): 16k-token packed rows under SDPA ran at half the padded MFU.
        log.warning("train.padding_free with %s attention masks each packed row with an N x N block-diagonal mask "
                    "(N = its tokens), so attention costs N^2 instead of the sum of the sequences' squares; on a GPU "
                    "set model.attn_implementation=varlen (docs/performance.md)",
                    cfg.model.attn_implementation or "sdpa")
    if cfg.model.compile:  # lazy: traced at the first update, after LoRA or sharding below
        log.info("model.compile: %d decoder blocks compile at the first update", compile_decoder_layers(model))
    indices = resolve_layer_indices(cfg.layers.indices, cfg.model.num_layers)
    if sync.uses_lora:
        model = apply_lora(model, cfg.lora, indices, cfg.model.num_layers)
    else:
        freeze_to_layers(model, indices)
    if dist_info is not None:
        distributed.shard_model(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("model %s: %.2fM trainable parameters in layers %s", type(model).__name__, trainable / 1e6,
             cfg.layers.indices)
    return model


def check_prefix_sharing_model(cfg: DictConfig, model: torch.nn.Module) -> None:
    """`train.prefix_sharing` on a model whose attention the shared rows cannot express: ConfigError at start-up."""
    from grpo.trainer.prefix import unsupported_reason

    why = unsupported_reason(model) if cfg.train.prefix_sharing else None
    if why is not None:
        raise ConfigError(f"train.prefix_sharing: {why}; set train.prefix_sharing=false")


def build_trainer(cfg, run_dir, model_dir, tokenizer, sync, loss_fn, data, evaluator, resume_ckpt, device, dist_info):
    """Launch the server, build model, optimizer, data source, evaluator and metrics, restore a checkpoint; the
    trainer."""
    from grpo.pipeline.base import BatchShape, PipelineContext
    from grpo.pipeline.distributed import FollowerPipeline, LeaderPipeline
    from grpo.pipeline.evaluation import EvalContext
    from grpo.sync.base import SyncContext
    from grpo.trainer import distributed
    from grpo.trainer.checkpoint import CheckpointManager
    from grpo.trainer.loop import GRPOTrainer, rollout_batches
    from grpo.trainer.metrics import MetricsLogger, NullMetrics
    from grpo.trainer.optim import build_optimizer, build_scheduler

    sync_ctx = SyncContext(run_dir=run_dir, model_dir=Path(model_dir), server_cfg=cfg.server, lora_cfg=cfg.lora,
                           tokenizer=tokenizer, resume_weights=resume_ckpt)
    sync.launch(sync_ctx)
    model = build_model(cfg, sync, sync_ctx, resume_ckpt, device, dist_info)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.train.lr_schedule, cfg.train.warmup_steps, cfg.train.steps)
    log.info("optimizer %s lr %g", type(optimizer).__name__, cfg.optimizer.lr)
    source = data if dist_info is None else (LeaderPipeline(data) if data is not None else FollowerPipeline())
    checkpoints = CheckpointManager(run_dir, keep=cfg.train.keep_checkpoints)
    start_step, start_batch = 0, None
    if resume_ckpt is not None:
        # FSDP2: rank 0 reads the checkpoint and broadcasts it into every rank's shards.
        load = checkpoints.load_distributed if dist_info is not None else checkpoints.load
        state = load(resume_ckpt, model, optimizer, scheduler)
        start_step = int(state["step"])
        start_batch = state.get("batch")
        source.load_state_dict(state.get("data", {}))
        log.info("resumed from %s at step %d", resume_ckpt, start_step)
    first_batch, total_batches = rollout_batches(cfg.train, start_step, start_batch)
    if data is not None:
        data.setup(PipelineContext(
            tokenizer=tokenizer, endpoint=sync.endpoint, batch_size=cfg.train.micro_batch_size * cfg.train.grad_accum,
            max_seq_len=cfg.model.max_seq_len, run_dir=run_dir, total_steps=total_batches, start_step=first_batch,
            checkpoint_every=cfg.train.checkpoint_every, seed=cfg.train.seed, max_staleness=cfg.train.max_staleness,
            generation_gate=sync.server.gate,
            batch_shape=BatchShape(
                micro_batch_size=cfg.train.micro_batch_size, max_seq_len=cfg.model.max_seq_len,
                pad_token_id=tokenizer.pad_token_id, vocab_size=model.get_input_embeddings().num_embeddings,
                advantage_norm=cfg.train.advantage_norm,
            ),
        ))
    if evaluator is not None:
        # Same server as the rollouts (the endpoint follows restarts and syncs); its own seeds and sampling.
        evaluator.setup(EvalContext(tokenizer=tokenizer, endpoint=sync.endpoint, run_dir=run_dir, seed=cfg.train.seed,
                                    total_steps=cfg.train.steps, max_seq_len=cfg.model.max_seq_len))
    # A resumed run's metrics.jsonl starts with the earlier rows up to the checkpoint (from the resumed run dir when
    # this one is another), so metrics, curves.png and grpo.report show the whole run.
    metrics = MetricsLogger(run_dir, cfg.logging, cfg, cfg.train.steps, start_step,
                            resumed_from=Path(cfg.train.resume) if resume_ckpt is not None else None,
                            name=cfg.name) if data is not None else NullMetrics()
    trainer = GRPOTrainer(
        train_cfg=cfg.train, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
        loss_fn=loss_fn, pipeline=source, sync=sync, checkpoints=checkpoints, metrics=metrics, device=device,
        start_step=start_step, start_batch=start_batch, dist=dist_info, evaluator=evaluator,
        logprob_fn=distributed.sharded_token_logprobs(model) if dist_info is not None else None,
    )
    return trainer, metrics


def _non_rank0_hydra_args() -> list[str]:
    """torchrun ranks > 0 keep Hydra's run dir and logs out of the run (rank 0 owns them)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0:
        return []
    import tempfile

    return ["hydra.output_subdir=null", f"hydra.run.dir={tempfile.gettempdir()}/grpo_rank{os.environ['RANK']}",
            "hydra/job_logging=stdout"]


def _config_dirs(args: list[str]) -> list[Path]:
    """The directories `--config-dir` / `-cd` add to the search path."""
    dirs = []
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--config-dir", "-cd"):
            dirs.append(Path(value or (args[i + 1] if i + 1 < len(args) else "")))
    return dirs


def run() -> None:
    """The command line's entry (`python train.py`, `grpo-train`): a choice whose Hydra plugin is missing is said
    before Hydra composes (its own error names no package), then the Hydra app."""
    from grpo.config.checks import check_config_dirs, check_group_option_names, check_hydra_plugins

    args = sys.argv[1:]
    try:
        check_hydra_plugins(args)
        check_config_dirs(_config_dirs(args))
        if not any(a.split("=", 1)[0] in ("--config-path", "-cp") for a in args):  # another primary config
            check_group_option_names(args, [Path(__file__).parent / "conf", *_config_dirs(args)])
    except ConfigError as e:
        config_error(e, multirun=False)
    sys.argv += _non_rank0_hydra_args()
    main()


if __name__ == "__main__":
    run()

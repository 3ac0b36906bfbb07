"""Start-up checks that need more than a schema: run before any model loads, fail with what to change."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from grpo.config import checks
from grpo.config.run_dir import check_resume_exists, check_resume_has_steps_left, check_run_dir, check_run_dir_unused
from grpo.config_values import ConfigError, option
from grpo.pipeline.rollout_queue import check_batches_in_flight, queue_capacity
from grpo.recipes.model_checks import check_model, check_model_files
from grpo.schema import LocalDataConfig, SharedMemorySyncConfig
from grpo.serving.checks import check_server
from grpo.serving.server import external_urls, replica_count
from grpo.trainer.layers import resolve_layer_indices
from grpo.trainer.metrics import tensorboard_writer_class
from grpo.trainer.optim import build_optimizer

__all__ = ["ConfigError", "validate"]


def _check_importable(target: str, key: str, install_hint: str) -> None:
    module = target.rsplit(".", 1)[0]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}={target} needs `{module}`, which is not importable ({e}). {install_hint}") from e


def validate(cfg: DictConfig, run_dir: Path | None = None) -> None:
    """Check everything that can be known before loading a model. Raises ConfigError naming the key.

    Each component checks its own part where it lives (the sync strategy: `SyncStrategy.check_config`); what
    spans components or concerns the machine is checked here."""
    # Config that would otherwise be silently ignored (grpo.config.checks).
    checks.check_known_keys(cfg)
    info = checks.hydra_info(cfg)
    checks.check_group_choices(info)
    checks.check_sweep_needs_multirun(info)
    checks.check_data_fits_default_experiment(info)
    checks.check_missing_values(cfg)
    check_loop_sizes(cfg)  # before the checks that compute with them
    checks.check_model_source(cfg.model, info)
    checks.check_lora_given_with_a_lora_mode(cfg, info)
    checks.check_async_settings_used(cfg, info)
    checks.check_memory_share_used(cfg, info)
    checks.check_grad_accum_used(cfg, info)
    checks.check_eval_settings_used(cfg, info)
    checks.check_eval_priority(cfg)
    checks.check_wandb_settings_used(cfg, info)
    check_model_files(cfg.model)
    check_layers(cfg)
    check_optimizer(cfg)
    # The loss checks its own settings when it is built, once (grpo.build.build_loss, first thing of the run).
    checks.check_clip_can_act(cfg, info)
    checks.check_truncation_options_have_what_they_read(cfg)
    sync_cls = get_class(cfg.mode._target_)
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's ranks on this host (fewer than WORLD_SIZE across nodes)
    sync_cls.check_config(cfg, cuda=_cuda_available(), world_size=int(os.environ.get("WORLD_SIZE", "1")),
                          local_world_size=int(local) if local else None)
    if cfg.train.device == "cuda" and not _cuda_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    check_model(cfg, cuda=_cuda_available())
    check_server(cfg, info.choices.get("server"), cuda=_cuda_available())
    check_train(cfg)
    check_prefix_sharing(cfg)
    check_data(cfg, info.choices.get("experiment"))
    check_tasks(cfg)
    check_replicas_reach_the_data(cfg)
    check_async(cfg)
    check_rollout_logprobs(cfg)
    check_off_policy_masks(cfg)
    check_quantized_rollouts(cfg, cuda=_cuda_available())
    check_logging(cfg)
    if run_dir is not None:
        check_run_dir(run_dir)
        check_run_dir_unused(cfg, run_dir)


def check_layers(cfg: DictConfig) -> None:
    """`layers.indices` resolves against the model's block count (the trainer's own parser decides)."""
    try:
        resolve_layer_indices(cfg.layers.indices, cfg.model.num_layers)
    except ValueError as e:
        raise ConfigError(f"layers.indices: {e}") from e


def check_optimizer(cfg: DictConfig) -> None:
    """The optimizer's package is importable (whether it accepts its settings: `check_optimizer_settings`)."""
    if cfg.optimizer._target_.startswith("bitsandbytes."):
        _check_importable(cfg.optimizer._target_, "optimizer", "Install it with `pip install bitsandbytes`, or choose optimizer=adamw.")
    else:
        _check_importable(cfg.optimizer._target_, "optimizer", "Install the package or choose another optimizer.")


def check_optimizer_settings(cfg: DictConfig) -> None:
    """The optimizer accepts its settings: torch checks lr, betas, eps and weight decay only when one is built, so it
    is built here on one parameter and `optimizer.lr=-1` stops the run before a model loads. Not part of `validate`:
    the first optimizer built imports torch._dynamo (seconds), which a run pays once vLLM is launched, while it
    starts (grpo.build.build_parts); the server started early stops with the error."""
    import torch

    try:
        build_optimizer(torch.nn.Linear(1, 1), cfg.optimizer)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer ({cfg.optimizer._target_}): {e}; set the optimizer.* key it names") from None


def check_loop_sizes(cfg: DictConfig) -> None:
    """Each loop size is >= 1; the message names the key that is not (it named all three of micro_batch_size,
    grad_accum and steps for any one of them)."""
    for key in ("micro_batch_size", "grad_accum", "steps", "ppo_epochs", "mini_batches"):
        if cfg.train[key] < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {cfg.train[key]}")


def check_train(cfg: DictConfig) -> None:
    """Loop sizes fit one another (each is >= 1: `check_loop_sizes`), the token budget is positive and
    `train.resume` exists (choices are typed by the schema)."""
    updates = cfg.train.ppo_epochs * cfg.train.mini_batches
    if cfg.train.steps % updates:
        raise ConfigError(
            f"train.steps={cfg.train.steps} counts optimizer steps and must be a multiple of train.ppo_epochs x "
            f"train.mini_batches = {updates} (each rollout batch gets that many updates); e.g. "
            f"train.steps={cfg.train.steps // updates * updates or updates}"
        )
    if cfg.train.mini_batches > cfg.train.micro_batch_size * cfg.train.grad_accum:
        raise ConfigError(
            f"train.mini_batches={cfg.train.mini_batches} exceeds the {cfg.train.micro_batch_size * cfg.train.grad_accum} "
            "sequences of a rollout batch (train.micro_batch_size x train.grad_accum)"
        )
    check_train_counts(cfg.train)
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is not None and budget < 1:
        raise ConfigError(f"train.max_tokens_per_micro_batch must be >= 1 (null = micro_batch_size rows under train.auto_token_budget), got {budget}")
    check_resume_exists(cfg)
    check_resume_has_steps_left(cfg)


# Attention kernels that take the shared rows' 4D mask as given (transformers' default is sdpa).
PREFIX_SHARING_ATTENTION = (None, "sdpa", "eager", "varlen")


def check_prefix_sharing(cfg: DictConfig) -> None:
    """`train.prefix_sharing` needs an attention kernel that takes a 4D mask, one process (the FSDP2 log-prob path
    forwards its own layout) and no `train.padding_free` (both lay out the rows)."""
    if not cfg.train.prefix_sharing:
        return
    attn = cfg.model.attn_implementation
    if attn not in PREFIX_SHARING_ATTENTION:
        raise ConfigError(f"train.prefix_sharing needs an attention kernel that takes its 4D mask (sdpa, eager or "
                          f"varlen); model.attn_implementation={attn} does not: set model.attn_implementation=sdpa "
                          "or train.prefix_sharing=false")
    if cfg.train.padding_free:
        raise ConfigError("train.prefix_sharing lays out its own rows (one per prompt, no padding between "
                          "sequences), so train.padding_free=true would be ignored: set train.padding_free=false")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("train.prefix_sharing is single-process only (FSDP2's sharded log-prob path forwards the "
                          "padded rows); set train.prefix_sharing=false under torchrun")


def check_train_counts(train: DictConfig) -> None:
    """Counts the loop reads only once it runs: each was an error after the server's start-up and a first step
    (`train.checkpoint_every=0`: ZeroDivisionError, before the step's checkpoint), or a traceback."""
    at_least = {"checkpoint_every": 1, "keep_checkpoints": 1, "logprob_chunk": 1, "max_nonfinite_steps": 1,
                "warmup_steps": 0}
    for key, low in at_least.items():
        if train[key] < low:
            raise ConfigError(f"train.{key} must be >= {low}, got {train[key]}")
    threads = train.get("torch_threads")
    if threads is not None and threads < 1:
        raise ConfigError(f"train.torch_threads must be >= 1, or null for torch's default (one per core); got {threads}")
    if train.max_grad_norm is not None and train.max_grad_norm <= 0:
        raise ConfigError(f"train.max_grad_norm must be > 0, or null for no gradient clipping; got "
                          f"{train.max_grad_norm}")


def check_async(cfg: DictConfig) -> None:
    """Asynchronous rollouts (`train.max_staleness >= 1`): a local data pipeline (run in a producer thread) or a
    source that generates on its own (Atropos: k drops older groups), a queue that holds a batch, and a loss whose
    ratio sees the rollout log-probs (stale groups are off-policy)."""
    k = cfg.train.max_staleness
    if k < 0:
        raise ConfigError(f"train.max_staleness must be >= 0 (0 = synchronous), got {k}")
    if k == 0:
        return
    if cfg.train.rollout_queue is not None and cfg.train.rollout_queue < 1:
        raise ConfigError(f"train.rollout_queue must be >= 1 or null, got {cfg.train.rollout_queue}")
    check_async_source(cfg)
    train = cfg.train
    if train.rollout_batches_in_flight > 1:
        capacity = queue_capacity(k, str(train.stale_policy), train.rollout_queue)
        try:
            check_batches_in_flight(train.rollout_batches_in_flight, capacity, get_class(cfg.data._target_))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    loss = cfg.loss
    if loss.old_logprobs == "recompute" and loss.tis_cap is None:
        raise ConfigError(
            f"train.max_staleness={k} trains on groups sampled up to {k} syncs ago; loss.old_logprobs=recompute "
            "without loss.tis_cap would take pi_old from the current weights and ignore that gap. Use "
            "loss.old_logprobs=rollout (the default: the ratio is against vLLM's log-probs) or set loss.tis_cap."
        )


def check_replicas_reach_the_data(cfg: DictConfig) -> None:
    """Several replicas need a data source the trainer generates for (its requests are spread over them): a source
    that generates on its own (Atropos environments) samples from the one server URL it was given."""
    replicas = replica_count(cfg.server)
    target = cfg.data.get("_target_")
    if replicas == 1 or target is None:
        return
    try:
        own = get_class(target).asynchronous_source
    except Exception:  # an optional source's package missing: building the source says so, with its hint
        return
    if own:
        raise ConfigError(
            f"server.replicas={replicas} with data={target.rsplit('.', 1)[-1]}: its environments sample from the one "
            "server URL they are given, so the other replicas would stay idle; use one replica (server.replicas=1) "
            "or a local data pipeline (data=local_*), whose requests the trainer spreads over the replicas"
        )


def check_data(cfg: DictConfig, experiment: str | None = None) -> None:
    """The data source's own checks (`check_config` of its class, e.g. LocalRolloutPipeline's), said here, before the
    server starts, rather than by the pipeline once it has."""
    target = cfg.data.get("_target_")
    try:
        cls = get_class(target) if target is not None else None
    except Exception:  # an optional source's package missing: building the source says so, with its hint
        return
    check = getattr(cls, "check_config", None)
    if check is not None:
        check(cfg, experiment)


def check_tasks(cfg: DictConfig) -> None:
    """The task's own checks (`check_config` of its class, e.g. PromptFileTask's: its prompt files exist), for
    data.task and eval.task, said with the exact key before anything is built."""
    for prefix in ("data.task", "eval.task"):
        node = OmegaConf.select(cfg, prefix, default=None)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        try:
            check = getattr(get_class(node._target_), "check_config", None)
        except Exception:  # a task that does not import: building it says so, with its hint
            continue
        if check is not None:
            check(node, prefix)


def check_rollout_logprobs(cfg: DictConfig) -> None:
    """`data.rollout_logprobs=false` trains every rollout as on-policy (pi_old = the trainer's own log-probs): exact
    only when a batch gets one update from the weights that sampled it. Each setting that trains off that policy, or
    reads the sampler's log-probs, would otherwise be silently wrong: the ratio is 1 and the clip never acts."""
    if cfg.data.get("rollout_logprobs", LocalDataConfig.rollout_logprobs) is not False:
        return
    loss, train = cfg.loss, cfg.train
    updates = train.ppo_epochs * train.mini_batches
    needs = [
        (loss.tis_cap is not None, f"loss.tis_cap={loss.tis_cap} weights tokens by pi_old / vLLM's "
         "sampling probability", "leave loss.tis_cap null"),
        (train.max_staleness > 0, f"train.max_staleness={train.max_staleness} trains on batches sampled by older "
         "weights", "use train.max_staleness=0"),
        (cfg.mode.sync_every > 1, f"mode.sync_every={cfg.mode.sync_every} samples "
         "batches with weights up to that many updates old", "use mode.sync_every=1"),
        (updates > 1 and loss.old_logprobs == "rollout", f"{updates} updates per batch "
         "(train.ppo_epochs x train.mini_batches) take pi_old from the rollout", "set loss.old_logprobs=recompute"),
        (float(loss.kl_coef) > 0, f"loss.kl_coef={loss.kl_coef} penalises the distance to the "
         "rollout policy", "set loss.kl_coef=0"),
        (bool(option(cfg.mode, "in_flight_updates", SharedMemorySyncConfig.in_flight_updates)),
         "mode.in_flight_updates=true samples rollouts from a "
         "mix of weights", "set mode.in_flight_updates=false"),
        (_masks(loss) != [], f"{' and '.join(_masks(loss))} mask tokens by pi_old / vLLM's sampling probability",
         "leave them null"),
    ]
    for wrong, what, fix in needs:
        if wrong:
            raise ConfigError(
                f"data.rollout_logprobs=false trains each rollout as on-policy, but {what}, which needs vLLM's "
                f"log-probs: {fix}, or keep data.rollout_logprobs=true"
            )


QUANTIZATIONS = ("fp8",)


def check_quantized_rollouts(cfg: DictConfig, cuda: bool) -> None:
    """`server.quantization=fp8`: vLLM quantizes the served weights itself, so rollouts are sampled from another
    policy than the trainer's. Needs a GPU vLLM launches on (its CPU engine has no FP8 kernels; a server started
    elsewhere has its own settings), and an off-policy correction reading vLLM's log-probs (truncated importance
    sampling or a mask). The mode's own refusal (`SyncStrategy.quantization_refusal`) is its check_config's."""
    quantization = cfg.server.get("quantization")
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"server.quantization={quantization} is not one of {', '.join(QUANTIZATIONS)} (or null: "
                          "the weights served as the trainer has them)")
    extra = [str(a).split("=", 1)[0] for a in cfg.server.get("extra_args") or []]
    if "--quantization" in extra or "-q" in extra:
        raise ConfigError(f"server.quantization={quantization} and --quantization in server.extra_args: set one")
    if external_urls(cfg.server):
        raise ConfigError(f"server.quantization={quantization} sets how the run launches vLLM, but the run attaches "
                          "to a server started elsewhere, with settings of its own: start that server with "
                          "--quantization fp8 and set server.quantization=null")
    if not cuda:
        raise ConfigError(f"server.quantization={quantization} needs vLLM on a CUDA GPU (its CPU engine has no FP8 "
                          "kernels); set server.quantization=null on this machine")
    loss = cfg.loss
    if loss.tis_cap is None and not _masks(loss):
        raise ConfigError(
            f"server.quantization={quantization} samples rollouts from FP8 weights while the trainer computes with its "
            "own, an off-policy gap no setting of this run corrects: set loss.old_logprobs=recompute with "
            "loss.tis_cap=2.0 (truncated importance sampling against vLLM's log-probs), or an off-policy mask "
            "(loss.token_mask=[0.5,2.0] or loss.sequence_mask=[...])")


def _masks(loss: DictConfig) -> list[str]:
    """The off-policy masks a loss config sets (`loss.token_mask=[..]`, ...)."""
    return [f"loss.{k}={list(loss[k])}" for k in ("token_mask", "sequence_mask") if loss.get(k) is not None]


def check_off_policy_masks(cfg: DictConfig) -> None:
    """The masks compare vLLM's log-probs with pi_old; with several updates per batch and pi_old taken from the
    current weights (`loss.old_logprobs=rollout`) they would also mask the batch's own updates' movement."""
    train, masks = cfg.train, _masks(cfg.loss)
    updates = train.ppo_epochs * train.mini_batches
    if masks and updates > 1 and cfg.loss.old_logprobs == "rollout":
        raise ConfigError(
            f"{' and '.join(masks)} with {updates} updates per batch (train.ppo_epochs x train.mini_batches) and "
            "loss.old_logprobs=rollout would compare vLLM's log-probs with weights the batch's updates already moved, "
            "masking the policy's own movement; set loss.old_logprobs=recompute (pi_old: the trainer's log-probs "
            "before the batch's first update)"
        )


def check_async_source(cfg: DictConfig) -> None:
    """k >= 1 needs a pipeline the producer can run ahead (`supports_async_rollouts`: the local ones) or an
    asynchronous source (Atropos), which can only drop: the trainer cannot make its environments wait, and it has no queue of its own."""
    k = cfg.train.max_staleness
    target = cfg.data.get("_target_")
    cls = get_class(target) if target is not None else None
    if cls is not None and getattr(cls, "asynchronous_source", False):
        if cfg.train.stale_policy != "drop":
            raise ConfigError(
                f"train.max_staleness={k} with data={target}: the environments generate on their own and the trainer "
                "cannot make them wait, so groups older than k versions can only be dropped; set "
                "train.stale_policy=drop (atroposlib's max_batches_offpolicy throttles environments on their side)"
            )
        if cfg.train.rollout_queue is not None:
            raise ConfigError(
                f"train.rollout_queue={cfg.train.rollout_queue} has no effect with data={target} (run-api holds the "
                "queue); leave it null"
            )
        if cfg.train.rollout_batches_in_flight != 1:
            raise ConfigError(
                f"train.rollout_batches_in_flight={cfg.train.rollout_batches_in_flight} has no effect with "
                f"data={target} (the environments generate on their own); leave it at 1"
            )
        return
    if not getattr(cls, "supports_async_rollouts", False):
        raise ConfigError(
            f"train.max_staleness={k} runs the local rollout pipeline in a producer thread; data={target} is neither "
            "one nor an asynchronous source like data=atropos. Use train.max_staleness=0 with it."
        )


def check_logging(cfg: DictConfig) -> None:
    """An optional logging sink's package is installed (say so before any model loads)."""
    if cfg.logging.tensorboard:
        try:
            tensorboard_writer_class()
        except ImportError as e:
            raise ConfigError(str(e)) from e


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

"""Start-up checks that need more than a schema: run before any model loads, fail with what to change."""

from __future__ import annotations

import difflib
import importlib
import os
import shutil
import socket
from pathlib import Path
from typing import NoReturn

from hydra.utils import get_class
from omegaconf import DictConfig

from grpo.config import checks
from grpo.inference.process import parallel_sizes
from grpo.models.loading import ATTN_IMPLEMENTATIONS
from grpo.models.packaged import PACKAGED_MODELS, PackagedModelMissing, gguf_path
from grpo.models.tiny import offline_presets
from grpo.options import ConfigError, instantiation_cause, option
from grpo.pipeline.local import LocalRolloutPipeline
from grpo.pipeline.rollout_queue import check_batches_in_flight, queue_capacity
from grpo.recipes.warmstart import WARMSTART_PRESETS
from grpo.trainer.checkpoint import COMPLETE, CheckpointManager, checkpoint_problems, read_trainer_state
from grpo.trainer.layers import resolve_layer_indices
from grpo.trainer.metrics import tensorboard_writer_class
from grpo.trainer.optim import build_optimizer

__all__ = ["ConfigError", "check_run_dir", "validate"]

# Below this much free space in the run dir, a full checkpoint of even a small model may not fit.
MIN_FREE_BYTES = 200 * 1024**2


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _check_importable(target: str, key: str, install_hint: str) -> None:
    module = target.rsplit(".", 1)[0]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}={target} needs `{module}`, which is not importable ({e}). {install_hint}") from e


def check_run_dir(run_dir: Path, key: str = "hydra.run.dir") -> None:
    """The run dir (`key` sets it) must be writable with room for checkpoints; checked before training starts."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run dir {run_dir} is not writable ({type(e).__name__}: {e}); set {key} to a "
                          "writable path") from None
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise ConfigError(
            f"run dir {run_dir} has only {free / 1024**2:.0f} MiB free (need at least "
            f"{MIN_FREE_BYTES / 1024**2:.0f} MiB for checkpoints); free space or set {key} elsewhere"
        )


def held_run(run_dir: Path) -> tuple[str, Path | None]:
    """What of an earlier run `run_dir` holds ("metrics.jsonl with rows, checkpoints up to step_000010", or ""), and
    its latest complete checkpoint (None when it has none)."""
    metrics = run_dir / "metrics.jsonl"
    has_rows = metrics.exists() and metrics.stat().st_size > 0
    latest = CheckpointManager(run_dir).latest()
    held = ", ".join(x for x in (f"{metrics.name} with rows" if has_rows else "",
                                 f"checkpoints up to {latest.name}" if latest is not None else "") if x)
    return held, latest


def check_sweep_dir_unused(sweep_dir: Path) -> None:
    """A sweep must not start in a dir whose jobs already ran (an explicit `hydra.sweep.dir` given twice): Hydra
    writes each job's `.hydra/` over the earlier job's record before any check inside the job can skip it."""
    if not sweep_dir.is_dir():
        return
    candidates = {p.parent for p in sweep_dir.rglob("metrics.jsonl")}
    candidates |= {p.parent for p in sweep_dir.rglob("checkpoints") if p.is_dir()}
    held = sorted(str(d.relative_to(sweep_dir)) for d in candidates if held_run(d)[0])
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ConfigError(
            f"sweep dir {sweep_dir} already holds runs (jobs {shown}), which this sweep's jobs would overwrite; "
            "pick another hydra.sweep.dir, or leave it out for a new dir under multirun/"
        )


def resumed_from(run_dir: Path) -> Path | None:
    """The run dir whose checkpoint `run_dir`'s run was resumed from into `run_dir` (provenance.json's
    `resumed_from`, written by grpo.run.record_provenance); None for a fresh run or one resumed in place."""
    import json

    try:
        given = json.loads((run_dir / "provenance.json").read_text()).get("resumed_from")
    except (OSError, ValueError, AttributeError):
        return None
    if given is None or Path(given).resolve() == run_dir.resolve():
        return None
    return Path(given)


def check_run_dir_unused(cfg: DictConfig, run_dir: Path) -> None:
    """A fresh run must not start in a run dir that holds another run's metrics or checkpoints: it would truncate
    that run's metrics.jsonl and replace its checkpoints. Continuing that run (`train.resume=<that dir>`) is fine,
    and so is resuming again from the run it was resumed from while it has no checkpoint of its own (a resume into
    another dir stopped before its first checkpoint: its rows past that checkpoint are trained again)."""
    resume = cfg.train.resume
    if resume is not None and Path(resume).resolve() == run_dir.resolve():
        return
    held, latest = held_run(run_dir)
    if not held:
        return
    origin = resumed_from(run_dir)
    if latest is None and resume is not None and origin is not None and origin.resolve() == Path(resume).resolve():
        return
    # Without a checkpoint there is nothing to continue: train.resume would refuse it in turn.
    go_on = (f"continue that run with train.resume={run_dir}, or " if latest is not None
             else "it has no checkpoint to continue from; ")
    raise ConfigError(
        f"run dir {run_dir} already holds a run ({held}), which this run would overwrite; {go_on}start a new one in "
        "another dir (hydra.run.dir=..., or leave it out for a new dir under outputs/)"
    )


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
    checks.check_model_source(cfg.model, info)
    checks.check_lora_given_with_a_lora_mode(cfg, info)
    checks.check_async_settings_used(cfg, info)
    checks.check_memory_share_used(cfg, info)
    checks.check_grad_accum_used(cfg, info)
    checks.check_eval_settings_used(cfg, info)
    checks.check_wandb_settings_used(cfg, info)
    checks.check_model_files(cfg.model)
    check_layers(cfg)
    check_optimizer(cfg)
    check_loss(cfg)
    checks.check_clip_can_act(cfg, info)  # after the loss's own range checks
    sync_cls = get_class(cfg.mode._target_)
    sync_cls.check_config(cfg, cuda=_cuda_available(), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.train.device == "cuda" and not _cuda_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    check_model(cfg)
    check_server(cfg, info.choices.get("server"))
    check_train(cfg)
    check_prefix_sharing(cfg)
    check_data(cfg, info.choices.get("experiment"))
    check_async(cfg)
    check_rollout_logprobs(cfg)
    check_off_policy_masks(cfg)
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
    """The optimizer's package is importable, and it accepts its settings (torch checks lr, betas, eps and weight
    decay when built: built here on one parameter, so `optimizer.lr=-1` stops the run before the server starts)."""
    import torch

    if cfg.optimizer._target_.startswith("bitsandbytes."):
        _check_importable(cfg.optimizer._target_, "optimizer", "Install it with `pip install bitsandbytes`, or choose optimizer=adamw.")
    else:
        _check_importable(cfg.optimizer._target_, "optimizer", "Install the package or choose another optimizer.")
    try:
        build_optimizer(torch.nn.Linear(1, 1), cfg.optimizer)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer ({cfg.optimizer._target_}): {e}; set the optimizer.* key it names") from None


def check_loss(cfg: DictConfig) -> None:
    """The loss checks its own settings when built (`grpo.trainer.loss`): build it once here, so a bad value (a
    clip-eps sweep's `loss.clip_eps=-0.1`) stops the run as a ConfigError before the server starts, not as a
    traceback from the run's own instantiate."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        instantiate(cfg.loss)
    except InstantiationException as e:
        cause = instantiation_cause(e)
        if not isinstance(cause, (ValueError, TypeError)):
            raise
        raise ConfigError(f"loss ({cfg.loss._target_}): {cause}; set the loss.* key it names") from None


def check_model(cfg: DictConfig) -> None:
    """A known attention kernel (FlexAttention on a CUDA trainer only); a local `model.name` exists; a hub id not
    in the local cache is refused when the hub is off or cannot be reached."""
    attn = cfg.model.attn_implementation
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"model.attn_implementation={attn} is not one of {', '.join(ATTN_IMPLEMENTATIONS)} "
                          "(or null for transformers' default)")
    trains_on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not _cuda_available())
    if attn == "flex_attention" and trains_on_cpu:
        raise ConfigError("model.attn_implementation=flex_attention needs a CUDA trainer (PyTorch's FlexAttention "
                          "has no backward pass on CPU); use sdpa, null or varlen (packed rows per sequence) on this machine")
    if cfg.model.offline is not None:
        check_offline_preset(str(cfg.model.offline))
        return
    name = cfg.model.name
    looks_local = name.startswith(("/", ".", "~")) or os.path.isabs(name)
    if looks_local and not Path(name).expanduser().exists():
        raise ConfigError(f"model.name={name} does not exist")
    if looks_local or Path(name).exists():
        return
    cached_config = _hub_cached_config(name)
    if cached_config is not None:
        checks.check_layer_count(cfg.model, cached_config)
        return
    instead = (f"point model.name at a local directory or set model.offline=<preset> for random weights of a known "
               f"shape ({', '.join(offline_presets())})")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(f"model.name={name} is a hub id, not in the local Hugging Face cache, and HF_HUB_OFFLINE=1; "
                          f"{instead}")
    reachable, where = _hub_reachable()
    if not reachable:
        # Without this the hub client retries for about a minute and ends in a traceback.
        raise ConfigError(f"model.name={name} is a hub id, not in the local Hugging Face cache, and the hub "
                          f"({where}) cannot be reached from here; {instead}, or fix the network (HF_ENDPOINT, proxy)")


def check_offline_preset(preset: str) -> None:
    """`model.offline` names a preset the model builder knows; else its ValueError was a traceback after the run's
    start-up lines. The model options' own names (`tiny_qwen2`, `warm_arith`) are the natural misspelling."""
    known = [*offline_presets(), *sorted(WARMSTART_PRESETS), *sorted(PACKAGED_MODELS)]
    if preset in PACKAGED_MODELS:
        try:
            gguf_path(preset)  # the package that carries it is installed: said before vLLM or the build starts
        except PackagedModelMissing as e:
            raise ConfigError(str(e)) from None
    if preset in known:
        return
    close = difflib.get_close_matches(preset.replace("_", "-"), known, n=1)
    hint = f"; did you mean model.offline={close[0]}?" if close else ""
    raise ConfigError(f"model.offline={preset} is not an offline model preset (those are {', '.join(known)}){hint} "
                      "(model.offline=null loads model.name instead)")


def _hub_cached_config(name: str) -> Path | None:
    """The hub model's config.json in the local Hugging Face cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    return Path(found) if isinstance(found, str) else None


def _hub_reachable(timeout_s: float = 3.0) -> tuple[bool, str]:
    """(whether a TCP connection to the hub's host opens within `timeout_s`, "host:port"); HF_ENDPOINT names the
    hub. Behind a proxy only the hub client knows the way, so it is given the benefit of the doubt."""
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True, f"{host}:{port}"
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False, f"{host}:{port}"
    return True, f"{host}:{port}"


def check_server_fits_model(cfg: DictConfig, model_dir: str | Path) -> None:
    """`server.max_model_len` within the model's `max_position_embeddings` (its config.json in `model_dir`, once the
    model directory exists): vLLM refuses a longer one, but only after its start-up, with a traceback in its log.
    `server=gpu`'s 4096 against the tiny models' 1024 was the first thing a GPU user of the default job met."""
    import json

    max_len = cfg.server.get("max_model_len")
    try:
        positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # not a directory with a readable config: loading the model says what is wrong
    if cfg.server.get("external_url") is None and max_len is not None and positions and max_len > positions:
        raise ConfigError(
            f"server.max_model_len={max_len} exceeds the model's max_position_embeddings={positions} "
            f"({Path(model_dir) / 'config.json'}), which vLLM refuses: set server.max_model_len={positions} (or less)"
        )


def check_server(cfg: DictConfig, choice: str | None = None) -> None:
    """The server's port is free (or an external server is named), its knobs are in range, and `server=gpu`
    (`choice`, the server group's option) has a GPU to run on."""
    if choice == "gpu" and cfg.server.external_url is None and not _cuda_available():
        # Else vLLM starts on the CPU with the GPU settings and fails on one of them (e.g. max_model_len).
        raise ConfigError("server=gpu runs the vLLM server on a CUDA GPU and none is visible here; use server=cpu "
                          "(the vLLM CPU engine), or attach to a GPU server with server.external_url=http://host:port")
    kv_cache_gb = cfg.server.get("kv_cache_gb")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise ConfigError(f"server.kv_cache_gb must be a positive number of GiB or null, got {kv_cache_gb}")
    if cfg.server.busy_loop_s is not None and cfg.server.busy_loop_s < 0:
        raise ConfigError(f"server.busy_loop_s must be >= 0 seconds or null, got {cfg.server.busy_loop_s}")
    if cfg.server.worker_in_engine_process and max(parallel_sizes(cfg.server.extra_args).values()) > 1:
        raise ConfigError(
            "server.worker_in_engine_process=true runs one vLLM worker, but server.extra_args="
            f"{list(cfg.server.extra_args)} asks for several: set server.worker_in_engine_process=false"
        )
    port_fixed = cfg.server.port is not None  # null: the launcher picks a free port
    if port_fixed and not 1 <= cfg.server.port <= 65535:
        # Else the bind below fails with Python's OverflowError traceback.
        raise ConfigError(f"server.port={cfg.server.port} is not a TCP port: use 1-65535, or null to pick a free one")
    if cfg.server.external_url is None and port_fixed and not _port_free(cfg.server.host, cfg.server.port):
        raise ConfigError(
            f"server.port={cfg.server.port} on {cfg.server.host} is already in use; pick a free port "
            "(server.port=...) or attach to that server with server.external_url=http://host:port"
        )


def check_train(cfg: DictConfig) -> None:
    """Loop sizes and the token budget are positive and `train.resume` exists (choices are typed by the schema)."""
    if cfg.train.micro_batch_size < 1 or cfg.train.grad_accum < 1 or cfg.train.steps < 1:
        raise ConfigError("train.micro_batch_size, train.grad_accum and train.steps must all be >= 1")
    if cfg.train.ppo_epochs < 1 or cfg.train.mini_batches < 1:
        raise ConfigError("train.ppo_epochs and train.mini_batches must be >= 1")
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
        raise ConfigError(f"train.max_tokens_per_micro_batch must be >= 1 (null = micro_batch_size rows), got {budget}")
    check_resume_exists(cfg)
    check_resume_has_steps_left(cfg)


# Attention kernels that take the shared rows' 4D mask as given (transformers' default is sdpa).
PREFIX_SHARING_ATTENTION = (None, "sdpa", "eager", "varlen")


def check_prefix_sharing(cfg: DictConfig) -> None:
    """`train.prefix_sharing` needs an attention kernel that takes a 4D mask, one process (the FSDP2 log-prob path
    forwards its own layout) and no `train.padding_free` (both lay out the rows)."""
    if not cfg.train.get("prefix_sharing", False):
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


def check_resume_exists(cfg: DictConfig) -> None:
    """`train.resume` names an existing path. Run by `grpo.run.RunDirGuard` before Hydra creates the run dir: a
    resume's default run dir is train.resume, so a mistyped or pruned path was created (.hydra/, train.log) and then
    refused as having 'no complete checkpoint'. A checkpoint that no longer exists (train.keep_checkpoints prunes
    older ones) gets its run dir named."""
    resume = cfg.train.resume
    if resume is None or Path(resume).exists():
        return
    path = Path(resume)
    if path.parent.name == "checkpoints" and path.parent.parent.is_dir():
        raise ConfigError(f"train.resume={resume} does not exist (a run keeps only its last train.keep_checkpoints "
                          f"checkpoints); train.resume takes the run dir, and the run goes on from its latest "
                          f"complete checkpoint: train.resume={path.parent.parent}")
    raise ConfigError(f"train.resume={resume} does not exist; give the run dir of the run to continue (its last "
                      "line says 'run dir: ...')")


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


def check_resume_has_steps_left(cfg: DictConfig) -> None:
    """`train.resume` is a run dir with a complete checkpoint (else `raise_for_resume_dir`). Resuming a run whose latest
    checkpoint already holds `train.steps` steps would start the server and train nothing: say so, with the setting
    that continues it."""
    if cfg.train.resume is None:
        return
    checkpoints = CheckpointManager(Path(cfg.train.resume), keep=cfg.train.keep_checkpoints)
    latest = checkpoints.latest()
    if latest is None:
        raise_for_resume_dir(Path(cfg.train.resume))
    problems = checkpoint_problems(latest)
    if problems:
        raise_for_damaged_checkpoint(cfg.train.resume, latest, problems, checkpoints.checkpoints()[:-1])
    done = int(read_trainer_state(latest).get("step", 0))
    if done >= cfg.train.steps:
        raise ConfigError(
            f"train.resume={cfg.train.resume}: its latest checkpoint ({latest.name}) is at step {done}, and "
            f"train.steps={cfg.train.steps}, so there is nothing left to train; to go on, raise train.steps "
            f"(e.g. train.steps={done + cfg.train.steps}; it counts from the run's start)"
        )


def raise_for_damaged_checkpoint(resume: str, latest: Path, problems: list[str], earlier: list[Path]) -> NoReturn:
    """Raises for a latest checkpoint with files missing or cut short: before, vLLM failed its start-up on it (a
    pydantic 'Unterminated string' for a cut-short model.safetensors) or the load a traceback. Not resumed from an
    earlier checkpoint silently: the message says how to (move the damaged one aside)."""
    if earlier:
        fix = (f"move it aside (mv {latest} {latest}.damaged) to resume from {earlier[-1].name}, the checkpoint "
               "before it")
    else:
        fix = "no earlier checkpoint is left, so start the run again without train.resume"
    raise ConfigError(f"train.resume={resume}: its latest checkpoint {latest} is damaged ({'; '.join(problems)}); "
                      f"{fix}")


def raise_for_resume_dir(resume: Path) -> NoReturn:
    """Raises for a `train.resume` without a complete checkpoint under its checkpoints/, saying what to give instead:
    its run dir when it is a checkpoint or the checkpoints/ dir itself (a natural guess that failed in the run with
    a FileNotFoundError traceback)."""
    run_dir = None
    if (resume / COMPLETE).exists() or (resume / "trainer_state.json").exists():
        run_dir = resume.parent.parent
    elif resume.name == "checkpoints":
        run_dir = resume.parent
    if run_dir is not None:
        raise ConfigError(f"train.resume={resume} is inside a run's checkpoints/; train.resume takes the run dir, "
                          f"and the run goes on from its latest complete checkpoint: train.resume={run_dir}")
    origin = resumed_from(resume)
    reachable = CheckpointManager(origin).latest() if origin is not None else None
    if reachable is not None:
        raise ConfigError(f"train.resume={resume} has no complete checkpoint of its own yet: it was resumed from "
                          f"{origin}, whose latest is {reachable}; continue from there into the same dir with "
                          f"train.resume={origin} hydra.run.dir={resume}")
    raise ConfigError(f"train.resume={resume} has no complete checkpoint under checkpoints/ (one is written every "
                      "train.checkpoint_every steps, and a run stopped before the first cannot be resumed); start it "
                      "again without train.resume, or name a run dir that has one")


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
    if get_class(cfg.mode._target_).mode_name == "lora_only" and k > 1:
        raise ConfigError(
            f"train.max_staleness={k} with mode=lora_only: each sync unloads the adapter of two syncs before, which a "
            "batch generated up to k syncs earlier may still be using; use train.max_staleness=1 with lora_only"
        )
    loss = cfg.loss
    if loss.get("old_logprobs", "rollout") == "recompute" and loss.get("tis_cap") is None:
        raise ConfigError(
            f"train.max_staleness={k} trains on groups sampled up to {k} syncs ago; loss.old_logprobs=recompute "
            "without loss.tis_cap would take pi_old from the current weights and ignore that gap. Use "
            "loss.old_logprobs=rollout (the default: the ratio is against vLLM's log-probs) or set loss.tis_cap."
        )


def check_data(cfg: DictConfig, experiment: str | None = None) -> None:
    """A local rollout pipeline generates at least the sequences one rollout batch trains on (said here, before the
    server starts, rather than by the pipeline once it has), and its completion caps fit model.max_seq_len."""
    target = cfg.data.get("_target_")
    try:
        local = target is not None and issubclass(get_class(target), LocalRolloutPipeline)
    except Exception:  # an optional source's package missing: building the source says so, with its hint
        return
    if not local:
        return
    # The pipeline and the evaluator cap a completion at the length bound minus its prompt: cut, silently.
    bounds = (("model.max_seq_len", cfg.model.max_seq_len), ("server.max_model_len", cfg.server.get("max_model_len")))
    for key, max_new in (("data", cfg.data.get("max_new_tokens")), ("eval", cfg.eval.get("max_new_tokens"))):
        for bound, max_len in bounds:
            if max_new is not None and max_len is not None and max_new >= max_len:
                raise ConfigError(
                    f"{key}.max_new_tokens={max_new} cannot be reached: {bound}={max_len} bounds prompt + completion "
                    f"(a prompt has at least one token); raise {bound} or lower {key}.max_new_tokens"
                )
    per_step = int(cfg.data.get("prompts_per_step", 0)) * int(cfg.data.get("group_size", 0))
    needed = cfg.train.micro_batch_size * cfg.train.grad_accum
    if per_step < needed:
        raise ConfigError(
            f"data.prompts_per_step x data.group_size = {per_step} sequences per step, fewer than the {needed} of "
            "train.micro_batch_size x train.grad_accum; raise data.prompts_per_step or data.group_size, or lower "
            "train.micro_batch_size or train.grad_accum"
            + (f" (experiment={experiment} sets the batch for its own data; '~experiment' gives the bare config)"
               if experiment else "")
        )


def check_rollout_logprobs(cfg: DictConfig) -> None:
    """`data.rollout_logprobs=false` trains every rollout as on-policy (pi_old = the trainer's own log-probs): exact
    only when a batch gets one update from the weights that sampled it. Each setting that trains off that policy, or
    reads the sampler's log-probs, would otherwise be silently wrong: the ratio is 1 and the clip never acts."""
    if cfg.data.get("rollout_logprobs", True) is not False:
        return
    loss, train = cfg.loss, cfg.train
    updates = train.ppo_epochs * train.mini_batches
    needs = [
        (loss.get("tis_cap") is not None, f"loss.tis_cap={loss.get('tis_cap')} weights tokens by pi_old / vLLM's "
         "sampling probability", "leave loss.tis_cap null"),
        (train.max_staleness > 0, f"train.max_staleness={train.max_staleness} trains on batches sampled by older "
         "weights", "use train.max_staleness=0"),
        (option(cfg.mode, "sync_every", 1) > 1, f"mode.sync_every={option(cfg.mode, 'sync_every', 1)} samples "
         "batches with weights up to that many updates old", "use mode.sync_every=1"),
        (updates > 1 and loss.get("old_logprobs", "rollout") == "rollout", f"{updates} updates per batch "
         "(train.ppo_epochs x train.mini_batches) take pi_old from the rollout", "set loss.old_logprobs=recompute"),
        (float(loss.get("kl_coef", 0.0)) > 0, f"loss.kl_coef={loss.get('kl_coef')} penalises the distance to the "
         "rollout policy", "set loss.kl_coef=0"),
        (bool(option(cfg.mode, "in_flight_updates", False)), "mode.in_flight_updates=true samples rollouts from a "
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


def _masks(loss: DictConfig) -> list[str]:
    """The off-policy masks a loss config sets (`loss.token_mask=[..]`, ...)."""
    return [f"loss.{k}={list(loss[k])}" for k in ("token_mask", "sequence_mask") if loss.get(k) is not None]


def check_off_policy_masks(cfg: DictConfig) -> None:
    """The masks compare vLLM's log-probs with pi_old; with several updates per batch and pi_old taken from the
    current weights (`loss.old_logprobs=rollout`) they would also mask the batch's own updates' movement."""
    train, masks = cfg.train, _masks(cfg.loss)
    updates = train.ppo_epochs * train.mini_batches
    if masks and updates > 1 and cfg.loss.get("old_logprobs", "rollout") == "rollout":
        raise ConfigError(
            f"{' and '.join(masks)} with {updates} updates per batch (train.ppo_epochs x train.mini_batches) and "
            "loss.old_logprobs=rollout would compare vLLM's log-probs with weights the batch's updates already moved, "
            "masking the policy's own movement; set loss.old_logprobs=recompute (pi_old: the trainer's log-probs "
            "before the batch's first update)"
        )


def check_async_source(cfg: DictConfig) -> None:
    """k >= 1 needs a local pipeline (wrapped in the producer) or an asynchronous source (Atropos), which can only
    drop: the trainer cannot make its environments wait, and it has no queue of its own."""
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
    if cls is None or not issubclass(cls, LocalRolloutPipeline):
        raise ConfigError(
            f"train.max_staleness={k} runs the local rollout pipeline in a producer thread; data={target} is neither "
            "one nor an asynchronous source like data=atropos. Use train.max_staleness=0 with it."
        )


def check_logging(cfg: DictConfig) -> None:
    """An optional logging sink's package is installed (say so before any model loads)."""
    if cfg.logging.get("tensorboard", False):
        try:
            tensorboard_writer_class()
        except ImportError as e:
            raise ConfigError(str(e)) from e


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

"""Start-up checks that need more than a schema: run before any model loads, fail with what to change.

Each component checks its own settings where it lives: the class a run selects for a component (its node's
`_target_`: the data source, its task and the evaluator's, the evaluator, the loss) has `check_config(cfg, ctx)`,
asked by one pass here (`check_components`), given a `CheckContext` (Hydra's record of the command line, the machine,
the other selected classes for the capabilities they declare). The sync strategy's `check_config` takes the machine's
facts as keywords; the server's checks are grpo.serving.checks', the model's grpo.recipes.model_checks'. What
concerns how the config was composed is grpo.config.checks', the trainer's own `train.*` settings
grpo.trainer.train_checks'."""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from grpo.config import checks
from grpo.config.run_dir import check_resume_exists, check_resume_has_steps_left, check_run_dir, check_run_dir_unused
from grpo.config_values import CheckContext, ConfigError
from grpo.recipes.model_checks import check_model, check_model_files
from grpo.serving.checks import check_memory_share_used, check_quantization, check_server
from grpo.trainer.metrics import tensorboard_writer_class
from grpo.trainer.optim import build_optimizer
from grpo.trainer.train_checks import check_layers, check_loop_sizes, check_prefix_sharing, check_train

__all__ = ["ConfigError", "validate"]

# The components a run selects by the `_target_` of their node, in the order their checks run (the first error a
# user sees is the earliest's): the data source, the tasks it and the evaluator prompt from, the evaluator, the loss.
COMPONENTS = ("data", "data.task", "eval.task", "eval", "loss")


def _check_importable(target: str, key: str, install_hint: str) -> None:
    module = target.rsplit(".", 1)[0]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}={target} needs `{module}`, which is not importable ({e}). {install_hint}") from e


def validate(cfg: DictConfig, run_dir: Path | None = None) -> None:
    """Check everything that can be known before loading a model. Raises ConfigError naming the key.

    First how the config was composed (keys nobody reads, settings that would be ignored), then the machine's and
    the trainer's own settings, the sync strategy and the server, then each selected component's own checks."""
    info = check_composition(cfg)
    cuda = _cuda_available()
    ctx = check_context(cfg, info, cuda)
    check_memory_share_used(cfg, ctx)
    check_model_files(cfg.model)
    check_layers(cfg)
    check_optimizer(cfg)
    sync_cls = get_class(cfg.mode._target_)
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's ranks on this host (fewer than WORLD_SIZE across nodes)
    sync_cls.check_config(cfg, cuda=cuda, world_size=ctx.world_size, local_world_size=int(local) if local else None)
    if cfg.train.device == "cuda" and not cuda:
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    check_model(cfg, cuda=cuda)
    check_server(cfg, info.choices.get("server"), cuda=cuda)
    check_quantization(cfg, cuda)
    check_train(cfg)
    check_resume_exists(cfg)
    check_resume_has_steps_left(cfg)
    check_prefix_sharing(cfg)
    check_components(cfg, ctx)
    check_logging(cfg)
    if run_dir is not None:
        check_run_dir(run_dir)
        check_run_dir_unused(cfg, run_dir)


def check_composition(cfg: DictConfig) -> checks.HydraInfo:
    """Config that would otherwise be silently ignored, or that Hydra composed to something nobody wrote
    (grpo.config.checks); returns Hydra's record of the run, which they read."""
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
    checks.check_wandb_settings_used(cfg, info)
    return info


def check_context(cfg: DictConfig, info: checks.HydraInfo, cuda: bool) -> CheckContext:
    """What each component's check is given beside the config: Hydra's record, the machine, the selected classes."""
    classes = {key: cls for key in ("mode", *COMPONENTS) if (cls := component_class(cfg, key)) is not None}
    return CheckContext(classes=classes, overrides=tuple(info.overrides), multirun=info.multirun,
                        experiment=info.choices.get("experiment"), cuda=cuda,
                        world_size=int(os.environ.get("WORLD_SIZE", "1")))


def component_class(cfg: DictConfig, key: str) -> Any:
    """The class the node at `key` names (`_target_`), or None: no such node, or its module does not import (an
    optional component's package missing: building it says so, with its hint)."""
    node = OmegaConf.select(cfg, key, default=None)
    if not isinstance(node, DictConfig) or node.get("_target_") is None:
        return None
    try:
        return get_class(str(node._target_))
    except Exception:
        return None


def check_components(cfg: DictConfig, ctx: CheckContext) -> None:
    """Each selected component's own checks (`check_config(cfg, ctx)` of its class, `ctx.key` its node's key), said
    before the server starts rather than by the component once it is built."""
    for key in COMPONENTS:
        check = getattr(ctx.classes.get(key), "check_config", None)  # a class of one's own may have none
        if check is not None:
            check(cfg, dataclasses.replace(ctx, key=key))


def check_data(cfg: DictConfig, experiment: str | None = None) -> None:
    """The data source's own checks alone (its class's `check_config`), for a composed config outside a run."""
    cls = component_class(cfg, "data")
    if cls is not None:
        cls.check_config(cfg, CheckContext(key="data", classes={"data": cls}, experiment=experiment))


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

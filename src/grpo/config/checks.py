"""Start-up checks of config that would otherwise be silently ignored (issue 21.6); each raises ConfigError.

`validate()` calls each with one line. They need, besides the config, what Hydra knows about how it was composed
(`hydra_info`: the chosen group options and the command-line overrides), read from the composed config's `hydra`
node when present (compose API with return_hydra_config=True) or from the running Hydra app.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Sequence

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from grpo.conf import EXPERIMENTS_DIR
from grpo.config.command_line import command_name
from grpo.config_values import ConfigError


@dataclasses.dataclass(frozen=True)
class HydraInfo:
    """The parts of Hydra's own record of a run that the checks read."""

    # Group -> chosen option, e.g. {"optimizer": "adamw"}.
    choices: Mapping[str, Any]
    # The command-line overrides, e.g. ["model.name=/x", "+optimzer.lr=1"].
    overrides: Sequence[str]
    # Started with -m / --multirun (a sweep).
    multirun: bool = False


def hydra_info(cfg: DictConfig) -> HydraInfo:
    """Choices and overrides from `cfg.hydra` (compose API) or the running Hydra app; empty when neither exists."""
    node = cfg.get("hydra") if OmegaConf.is_dict(cfg) else None
    if node is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return HydraInfo(choices={}, overrides=())
        node = HydraConfig.get()
    return HydraInfo(choices=dict(node.runtime.choices), overrides=list(node.overrides.task),
                     multirun=node.get("mode") == RunMode.MULTIRUN)


def check_known_keys(cfg: DictConfig) -> None:
    """Every key of a typed node is a field of its schema. Hydra's `+key=value` adds keys even to typed nodes, so a
    misspelt `+optimzer.lr=1` (the form Hydra's own error suggests) would otherwise be carried along unread."""
    for path, node in _typed_nodes(cfg, ""):
        fields = {f.name for f in dataclasses.fields(OmegaConf.get_type(node))}
        for key in node.keys():
            if key in fields or (path == "" and key == "hydra"):
                continue
            where = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f"; did you mean {(path + '.' if path else '') + close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {where} (added with +{where}=...?): nothing reads it{hint}")


def check_missing_values(cfg: DictConfig) -> None:
    """Every mandatory value (`???` in a YAML, e.g. `data=prompt_file`'s `data.task.path`) is set; else the component
    that reads it fails in Hydra's MissingMandatoryValue, wrapped in its instantiation error."""
    missing = sorted(_missing_keys(cfg, ""))
    if missing:
        example = " ".join(f"{k}=..." for k in missing)
        raise ConfigError(f"{', '.join(missing)} must be set (??? in the config, no default); add {example} to the "
                          "command line or to your experiment file")


def _missing_keys(node: Any, path: str):
    """Dotted keys of every `???` value under `node` (not `OmegaConf.missing_keys`: it resolves interpolations, and
    the hydra node's need a running Hydra app)."""
    keys = node.keys() if OmegaConf.is_dict(node) else range(len(node)) if OmegaConf.is_list(node) else ()
    for key in keys:
        if path == "" and key == "hydra":
            continue
        where = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_missing(node, key):
            yield where
            continue
        child = OmegaConf.select(node, str(key), throw_on_missing=False, throw_on_resolution_failure=False)
        yield from _missing_keys(child, where)


def _typed_nodes(node: Any, path: str):
    """(dotted path, node) of every dict node whose type is a schema dataclass, depth first."""
    if not OmegaConf.is_dict(node):
        return
    node_type = OmegaConf.get_type(node)
    if node_type is not None and dataclasses.is_dataclass(node_type):
        yield path, node
    for key in node.keys():
        if path == "" and key == "hydra":
            continue
        # select() with these flags never raises on a missing (???) or unresolvable value: only dict nodes matter.
        child = OmegaConf.select(node, str(key), throw_on_missing=False, throw_on_resolution_failure=False)
        if OmegaConf.is_dict(child):
            yield from _typed_nodes(child, f"{path}.{key}" if path else str(key))


def check_group_choices(info: HydraInfo) -> None:
    """No group option may be a schema entry (`optimizer=adamw_schema`): those are the typed bases the YAML options
    build on, listed by `--help` beside them, and compose to a config nobody wrote."""
    for group, option in info.choices.items():
        if isinstance(option, str) and option.endswith("_schema") and not group.startswith("hydra"):
            options = [o for o in _group_options(group) if not o.endswith("_schema")]
            listed = f"; choose one of {', '.join(options)}" if options else ""
            raise ConfigError(
                f"{group}={option} is the schema behind the {group} options, not an option itself{listed}"
            )


def check_sweep_needs_multirun(info: HydraInfo) -> None:
    """A `sweep=` option only sets Hydra's sweeper: without -m Hydra runs one job with none of its values."""
    option = info.choices.get("sweep")
    if option is not None and not info.multirun:
        raise ConfigError(f"sweep={option} sets the values a sweep runs over, and without -m Hydra runs one job with "
                          f"none of them; add -m ({command_name()} -m sweep={option} ...), or drop sweep={option}")


def _group_options(group: str) -> list[str]:
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    return sorted(gh.config_loader().get_group_options(group)) if gh.is_initialized() else []


def check_data_fits_default_experiment(info: HydraInfo) -> None:
    """`data=<option>` on the command line under the experiment conf/train.yaml applies by default (arith_quick),
    when that experiment was written for other data: the run took the experiment's name, model, batch and learning
    rate without a word (`python train.py data=atropos` was labelled arith_quick and trained its warm-start model).
    An experiment named on the command line (`experiment=x data=y`) is the user's own combination: allowed."""
    experiment, data = info.choices.get("experiment"), info.choices.get("data")
    if experiment is None or data is None:
        return
    given = [o.split("=", 1)[0].lstrip("+~") for o in info.overrides]
    if "experiment" in given or "data" not in given:
        return
    written_for = _experiment_data(experiment)
    if written_for is None or written_for == data:
        return
    raise ConfigError(
        f"data={data} runs under experiment={experiment}, which conf/train.yaml applies by default and which was "
        f"written for data={written_for} (it sets its own name, model, batch and learning rate); for the bare config "
        f"with your data add '~experiment' ({command_name()} '~experiment' data={data} ...), or name an experiment "
        f"written for it (experiment=...)"
    )


def _experiment_data(name: str) -> str | None:
    """The data option a shipped experiment's defaults choose (`override /data: arithmetic`), None when it chooses
    none or is not a shipped one."""
    path = EXPERIMENTS_DIR / f"{name}.yaml"
    if not path.is_file():
        return None
    for entry in OmegaConf.load(path).get("defaults") or []:
        if OmegaConf.is_dict(entry):
            for key, value in entry.items():
                if str(key).removeprefix("override ").strip("/ ") == "data":
                    return str(value)
    return None


def check_model_source(model_cfg: DictConfig, info: HydraInfo) -> None:
    """A model.name given on the command line must win or fail: with an offline preset in effect the preset would be
    built and the given name silently ignored."""
    given = [o for o in info.overrides if o.lstrip("+~").split("=", 1)[0] == "model.name"]
    if given and model_cfg.offline:
        raise ConfigError(
            f"model.name={model_cfg.name} was given, but model.offline={model_cfg.offline} builds the offline "
            f"preset and would ignore it. To train your model set model.offline=null (and model.num_layers to its "
            f"block count); to train the preset drop model.name"
        )


def check_lora_given_with_a_lora_mode(cfg: DictConfig, info: HydraInfo) -> None:
    """`lora=...` or `lora.*=...` on the command line must reach a LoRA: with a full fine-tuning mode (mode=none,
    shared_vllm, broadcast) every weight trains and the LoRA settings would be silently ignored. Not in a sweep,
    whose settings are common to its jobs (`-m mode=none,lora_only lora.r=8`)."""
    from hydra.utils import get_class

    if info.multirun:
        return
    given = [o for o in info.overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "lora"]
    mode = get_class(cfg.mode._target_)
    if given and not mode.uses_lora:
        raise ConfigError(
            f"{' '.join(given)} sets the LoRA adapter, but mode={mode.mode_name} trains the full weights (no adapter) "
            "and would ignore it; for an adapter pick mode=lora_only or mode=lora_restart, else drop the lora settings"
        )


def check_async_settings_used(cfg: DictConfig, info: HydraInfo) -> None:
    """`train.stale_policy`, `train.rollout_queue` and `train.rollout_batches_in_flight` act only with asynchronous
    rollouts (`train.max_staleness >= 1`), and `rollout_queue` only bounds stale_policy=drop's queue: otherwise they
    would be silently ignored. Not in a sweep, whose settings are common to its jobs (`-m train.max_staleness=0,1
    train.stale_policy=drop`)."""
    if info.multirun:
        return
    train = cfg.train
    if train.max_staleness == 0:
        for key, default in (("stale_policy", "wait"), ("rollout_queue", None), ("rollout_batches_in_flight", 1)):
            if train[key] != default:
                raise ConfigError(f"train.{key}={train[key]} acts only with asynchronous rollouts; set "
                                  "train.max_staleness=k >= 1 (docs/async.md), or drop it")
    elif train.stale_policy == "wait" and train.rollout_queue is not None:
        raise ConfigError(f"train.rollout_queue={train.rollout_queue} bounds the queue of stale_policy=drop only (with "
                          f"wait the producer runs at most max_staleness={train.max_staleness} batches ahead); set "
                          "train.stale_policy=drop, or drop train.rollout_queue")


def _given(info: HydraInfo, *keys: str) -> list[str]:
    """The command-line overrides (`key=value`, `+key=value`) of these keys."""
    return [o for o in info.overrides if o.lstrip("+~").split("=", 1)[0] in keys]


def check_wandb_settings_used(cfg: DictConfig, info: HydraInfo) -> None:
    """`logging.wandb_project` / `wandb_entity` on the command line without `logging.wandb=true`: nothing is sent to
    W&B and the settings would be silently ignored (the Atropos trainer's --wandb-project implied its logging)."""
    given = _given(info, "logging.wandb_project", "logging.wandb_entity")
    if given and not cfg.logging.wandb and not info.multirun:
        raise ConfigError(f"{' '.join(given)} would be ignored: W&B logging is off; add logging.wandb=true (offline "
                          "unless WANDB_API_KEY is set), else drop it")

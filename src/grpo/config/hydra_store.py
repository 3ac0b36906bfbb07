"""Hydra's view of the typed schemas (`grpo.schema`, where the classes are imported from): `register_configs` stores
each in the ConfigStore, under the name its group's YAML options list first in their defaults (`loss_schema`, ...),
and registers our resolvers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from grpo.config.key_help import config_keys
from grpo.schema import (
    AdafactorConfig,
    AdamW8bitConfig,
    AdamWConfig,
    AgentDataConfig,
    AtroposDataConfig,
    CheckpointRestartSyncConfig,
    EvalConfig,
    LayersConfig,
    LocalDataConfig,
    LoraConfig,
    LoraHotSwapSyncConfig,
    LoraRestartSyncConfig,
    LossConfig,
    ModelConfig,
    MultiTurnDataConfig,
    NCCLBroadcastSyncConfig,
    RootConfig,
    ServerConfig,
    SharedMemorySyncConfig,
)

__all__ = ["config_dir_path", "config_groups", "first_set", "register_configs"]


def first_set(*values: Any) -> Any:
    """The first value that is not null (None when all are): `${grpo.first_set:${train.resume},<default dir>}`."""
    return next((v for v in values if v is not None), None)


def config_groups() -> str:
    """`--help`'s list of groups and their options, one line per group, without the `*_schema` entries: those are
    the typed bases the group's YAML files build on (registered in the same groups), not options to pick."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():  # resolved outside a Hydra app (e.g. a saved hydra.yaml)
        return "(python train.py --help lists them)"
    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> list[str]:
        names = [f"{parent}/{g}" if parent else g for g in loader.list_groups(parent)]
        return [g for name in names if not name.startswith("hydra") for g in [name, *groups(name)]]

    lines = []
    for group in sorted(groups("")):
        options = [o for o in sorted(loader.get_group_options(group)) if not o.endswith("_schema")]
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)


def config_dir_path(relative: str, *, _root_: Any) -> str:
    """`${grpo.config_dir:<path>}`: `<path>` resolved against the `--config-dir` the run was given (or a
    `hydra.searchpath` entry), so that a config dir's files (an example's prompts beside its conf/) are found from any
    working directory. The job's config has no `hydra` node: Hydra's own record of it is read then."""
    from hydra.core.hydra_config import HydraConfig

    # A config composed with its hydra node (compose(return_hydra_config=True)) names its own sources; a job's config
    # has none, and Hydra's record of the running job is read.
    hydra = OmegaConf.select(_root_, "hydra", default=None)
    if hydra is None and HydraConfig.initialized():
        hydra = HydraConfig.get()
    every = list(hydra.runtime.config_sources) if hydra is not None else []
    sources = ([s for s in every if s.schema == "file" and s.provider == "command-line"]
               or [s for s in every if s.schema == "file" and str(s.provider).startswith("hydra.searchpath")])
    if not sources:
        raise ValueError(f"${{grpo.config_dir:{relative}}} resolves against the --config-dir of the command line, and "
                         "none was given: run with --config-dir <the conf dir that holds this file>, or give the path")
    base = Path(sources[0].path)
    if not base.is_absolute():
        base = Path(hydra.runtime.cwd) / base
    return str((base / relative).resolve())


def register_configs() -> None:
    """Register every schema (each group YAML names its schema in its defaults list) and our resolvers."""
    # conf/train.yaml's hydra.run.dir: a resumed run continues in the run dir it resumes (train.resume).
    OmegaConf.register_new_resolver("grpo.first_set", first_set, replace=True)
    # conf/train.yaml's hydra.help.template: the groups a user picks from.
    OmegaConf.register_new_resolver("grpo.config_groups", config_groups, replace=True)
    # ... and every key with its value and the first sentence of its schema comment.
    OmegaConf.register_new_resolver("grpo.config_keys", config_keys, replace=True)
    # A path relative to the --config-dir (an example's data files beside its conf/).
    OmegaConf.register_new_resolver("grpo.config_dir", config_dir_path, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="optimizer", name="adamw_schema", node=AdamWConfig)
    cs.store(group="optimizer", name="adamw_8bit_schema", node=AdamW8bitConfig)
    cs.store(group="optimizer", name="adafactor_schema", node=AdafactorConfig)
    cs.store(group="loss", name="loss_schema", node=LossConfig)
    cs.store(group="layers", name="layers_schema", node=LayersConfig)
    cs.store(group="lora", name="lora_schema", node=LoraConfig)
    cs.store(group="server", name="server_schema", node=ServerConfig)
    cs.store(group="mode", name="none_schema", node=CheckpointRestartSyncConfig)
    cs.store(group="mode", name="lora_restart_schema", node=LoraRestartSyncConfig)
    cs.store(group="mode", name="lora_only_schema", node=LoraHotSwapSyncConfig)
    cs.store(group="mode", name="shared_vllm_schema", node=SharedMemorySyncConfig)
    cs.store(group="mode", name="broadcast_schema", node=NCCLBroadcastSyncConfig)
    cs.store(group="data", name="atropos_schema", node=AtroposDataConfig)
    cs.store(group="data", name="local_schema", node=LocalDataConfig)
    cs.store(group="data", name="multi_turn_schema", node=MultiTurnDataConfig)
    cs.store(group="data", name="agent_schema", node=AgentDataConfig)
    cs.store(group="eval", name="eval_schema", node=EvalConfig)

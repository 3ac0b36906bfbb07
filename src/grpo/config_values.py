"""One way to read an option from any config object: a DictConfig, a dataclass, a plain dict or a namespace.

Components take the config node they are given (Hydra's DictConfig in a run, a schema dataclass or a dict in
tests and benchmarks); this reads a key from any of them with a default. Also the config error every layer raises,
the error a config caused inside Hydra's instantiate, and what a component's start-up check is given beside the config
(`CheckContext`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence


def option(cfg: Any, key: str, default: Any = None) -> Any:
    """`cfg[key]` (mapping) or `cfg.key` (object), `default` when absent or when `cfg` is None."""
    if cfg is None:
        return default
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


class ConfigError(ValueError):
    """A config that composes but cannot run; the message says which key to change."""


def instantiation_cause(error: BaseException) -> BaseException:
    """The error a config caused inside `hydra.utils.instantiate`: Hydra wraps it in an InstantiationException once
    per nested `_target_`, and printing the wrappers buries the one line that names the bad value."""
    from hydra.errors import InstantiationException

    cause = error
    while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
        cause = cause.__cause__
    return cause


@dataclass(frozen=True)
class CheckContext:
    """What a component's start-up check, `check_config(cfg, ctx)` of its class, is given beside the run's config
    `cfg` (grpo.config.validate asks each component the run selects for it, before anything is built).

    Args:
        key: the dotted key of the component's own node (`loss`, `data.task`, `eval.task`): `node(cfg)` reads it.
        classes: the class each selected component's `_target_` names, by key (`data`, `loss`, `mode`, ...), for the
            capabilities it declares (a data source's `reports_truncation`); absent when its module does not import.
        overrides: the command-line overrides (`key=value`, `+key=value`), for a setting that was given but would be
            ignored; `multirun`: started with -m (a sweep's settings are common to its jobs: not refused).
        experiment: the chosen experiment, for a message.
        cuda: a CUDA device is visible; `world_size`: the trainer's ranks.
    """

    key: str = ""
    classes: Mapping[str, Any] = field(default_factory=dict)
    overrides: Sequence[str] = ()
    multirun: bool = False
    experiment: Optional[str] = None
    cuda: bool = False
    world_size: int = 1

    def node(self, cfg: Any) -> Any:
        """The component's own node of `cfg` (at `key`)."""
        for part in self.key.split(".") if self.key else ():
            cfg = option(cfg, part)
        return cfg

    def given(self, *keys: str) -> list[str]:
        """The command-line overrides of these keys (`key=value`, `+key=value`), as typed."""
        return [o for o in self.overrides if o.lstrip("+~").split("=", 1)[0] in keys]

"""One way to read an option from any config object: a DictConfig, a dataclass, a plain dict or a namespace.

Components take the config node they are given (Hydra's DictConfig in a run, a schema dataclass or a dict in
tests and benchmarks); this reads a key from any of them with a default. Also the config error every layer raises,
and the error a config caused inside Hydra's instantiate.
"""

from __future__ import annotations

from typing import Any, Mapping


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

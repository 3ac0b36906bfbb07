"""One way to read an option from any config object: a DictConfig, a dataclass, a plain dict or a namespace.

Components take the config node they are given (Hydra's DictConfig in a run, a schema dataclass or a dict in
tests and benchmarks); this reads a key from any of them with a default.
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

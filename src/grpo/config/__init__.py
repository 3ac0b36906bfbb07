"""Config schemas (registered with Hydra) and start-up validation."""

from grpo.config.schema import register_configs
from grpo.config.validate import ConfigError, validate

__all__ = ["ConfigError", "register_configs", "validate"]

"""A run's config composed and validated: the typed schemas (`grpo.schema`) registered with Hydra
(`hydra_store`), and the start-up checks that span components (`validate`)."""

from grpo.config.hydra_store import register_configs
from grpo.config.validate import ConfigError, validate

__all__ = ["ConfigError", "register_configs", "validate"]

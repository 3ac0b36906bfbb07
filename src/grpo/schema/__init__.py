"""Typed schemas of every config group: the bottom of the config, importable by every component.

One module per component (`model`, `optimizer`, `loss`, `sync`, `server`, `data`, `train`); a component takes its own
schema (or any object or mapping with its fields: `grpo.config_values.option`). `grpo.config.hydra_store` registers them with
Hydra's ConfigStore, and each YAML option of a group lists its schema first in its defaults, so a misspelled key or a
value of the wrong type fails at composition time with the key in the message, before any model loads. Polymorphic
groups (optimizer, mode, data) have one schema per option. The choice sets are enums: of a registry's names
(`grpo.algorithms`) or written here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from grpo.schema.data import AgentDataConfig, AtroposDataConfig, EvalConfig, LocalDataConfig, MultiTurnDataConfig
from grpo.schema.loss import Aggregation, KLEstimator, LossConfig, Objective, OldLogprobs
from grpo.schema.model import DType, LayersConfig, LoraConfig, ModelConfig
from grpo.schema.optimizer import AdafactorConfig, AdamW8bitConfig, AdamWConfig
from grpo.schema.server import ServerConfig
from grpo.schema.sync import (
    CheckpointRestartSyncConfig,
    LoraHotSwapSyncConfig,
    LoraRestartSyncConfig,
    NCCLBroadcastSyncConfig,
    SharedMemorySyncConfig,
)
from grpo.schema.train import AdvantageNorm, Device, LoggingConfig, LRSchedule, StalePolicy, TrainConfig

__all__ = [
    "AdafactorConfig", "AdamW8bitConfig", "AdamWConfig", "AdvantageNorm", "Aggregation", "AtroposDataConfig",
    "CheckpointRestartSyncConfig", "DType", "Device", "EvalConfig", "KLEstimator", "LRSchedule", "LayersConfig",
    "LocalDataConfig", "AgentDataConfig", "LoggingConfig", "MultiTurnDataConfig", "LoraConfig", "LoraHotSwapSyncConfig",
    "LoraRestartSyncConfig", "LossConfig", "ModelConfig", "NCCLBroadcastSyncConfig", "Objective", "OldLogprobs",
    "RootConfig", "ServerConfig", "SharedMemorySyncConfig",
    "StalePolicy", "TrainConfig",
]


@dataclass
class RootConfig:
    """The whole run: one node per config group."""

    model: ModelConfig = MISSING
    optimizer: Any = MISSING
    loss: LossConfig = MISSING
    layers: LayersConfig = MISSING
    lora: LoraConfig = MISSING
    mode: Any = MISSING
    server: ServerConfig = MISSING
    data: Any = MISSING
    eval: Any = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Run name: names the run dir (outputs/<date>/<time>_<name>), labels the progress bar and train.log's start-up line,
    # and names the W&B run (logging.wandb). Each experiment sets its own; the bare config ('~experiment') is grpo.
    name: str = "grpo"

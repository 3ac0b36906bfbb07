"""The trainer's own start-up checks: the `train.*` loop sizes and counts, the layers it trains, the prefix-sharing
layout; each a ConfigError naming the key (grpo.config.validate calls them before any model loads)."""

from __future__ import annotations

import os
from typing import Any

from grpo.config_values import ConfigError
from grpo.trainer.layers import resolve_layer_indices


def check_loop_sizes(cfg: Any) -> None:
    """Each loop size is >= 1; the message names the key that is not (it named all three of micro_batch_size,
    grad_accum and steps for any one of them)."""
    for key in ("micro_batch_size", "grad_accum", "steps", "ppo_epochs", "mini_batches"):
        if cfg.train[key] < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {cfg.train[key]}")


def check_train(cfg: Any) -> None:
    """Loop sizes fit one another (each is >= 1: `check_loop_sizes`) and the counts and the token budget are in
    range (choices are typed by the schema)."""
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
        raise ConfigError(f"train.max_tokens_per_micro_batch must be >= 1 (null = micro_batch_size rows under train.auto_token_budget), got {budget}")


def check_train_counts(train: Any) -> None:
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


def check_layers(cfg: Any) -> None:
    """`layers.indices` resolves against the model's block count (the trainer's own parser decides)."""
    try:
        resolve_layer_indices(cfg.layers.indices, cfg.model.num_layers)
    except ValueError as e:
        raise ConfigError(f"layers.indices: {e}") from e


# Attention kernels that take the shared rows' 4D mask as given (transformers' default is sdpa).
PREFIX_SHARING_ATTENTION = (None, "sdpa", "eager", "varlen")


def check_prefix_sharing(cfg: Any) -> None:
    """`train.prefix_sharing` needs an attention kernel that takes a 4D mask, one process (the FSDP2 log-prob path
    forwards its own layout) and no `train.padding_free` (both lay out the rows)."""
    if not cfg.train.prefix_sharing:
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

"""The model a run trains: the sync strategy's own (shared_vllm) or loaded from the initial weights or a checkpoint,
with its attention kernel, LoRA or frozen layers, and sharded under torchrun; and the frozen initial policy a KL
penalty measures against."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from grpo.config_values import ConfigError
from grpo.models.loading import compile_decoder_layers, load_model, pick_dtype, prepare_for_training, set_attention
from grpo.sync.base import SyncContext, SyncStrategy
from grpo.trainer import fsdp
from grpo.trainer.fsdp import DistInfo
from grpo.trainer.layers import apply_lora, freeze_to_layers, resolve_layer_indices
from grpo.trainer.loss_interface import PolicyLoss
from grpo.trainer.prefix import unsupported_reason
from grpo.trainer.reference import ReferencePolicy

log = logging.getLogger(__name__)


def build_model(cfg: DictConfig, sync: SyncStrategy, sync_ctx: SyncContext, resume_ckpt: Path | None,
                device: torch.device, dist_info: DistInfo | None) -> torch.nn.Module:
    """The trainable model: the strategy's own (shared_vllm) or loaded, with LoRA or frozen layers, sharded under
    torchrun."""
    model = sync.load_model(sync_ctx)
    if model is None:
        base = sync_ctx.model_dir if (resume_ckpt is None or sync.uses_lora) else resume_ckpt
        model = load_model(str(base), pick_dtype(cfg.model.dtype, device), device, cfg.model.gradient_checkpointing)
    else:  # the strategy's own model (shared_vllm's views of vLLM's tensors) gets the same training set-up
        model = prepare_for_training(model, cfg.model.gradient_checkpointing)
    set_attention(model, cfg.model.attn_implementation)
    check_prefix_sharing_model(cfg, model)
    if cfg.train.padding_free and device.type == "cuda" and cfg.model.attn_implementation in (None, "sdpa", "eager"):
        # Measured on an H100 (docs/performance.md): 16k-token packed rows under SDPA ran at half the padded MFU.
        log.warning("train.padding_free with %s attention masks each packed row with an N x N block-diagonal mask "
                    "(N = its tokens), so attention costs N^2 instead of the sum of the sequences' squares; on a GPU "
                    "set model.attn_implementation=varlen (docs/performance.md)",
                    cfg.model.attn_implementation or "sdpa")
    if cfg.model.compile:  # lazy: traced at the first update, after LoRA or sharding below
        log.info("model.compile: %d decoder blocks compile at the first update", compile_decoder_layers(model))
    indices = resolve_layer_indices(cfg.layers.indices, cfg.model.num_layers)
    if sync.uses_lora:
        model = apply_lora(model, cfg.lora, indices, cfg.model.num_layers)
    else:
        freeze_to_layers(model, indices)
    if dist_info is not None:
        fsdp.shard_model(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("model %s: %.2fM trainable parameters in layers %s", type(model).__name__, trainable / 1e6,
             cfg.layers.indices)
    return model


def check_prefix_sharing_model(cfg: DictConfig, model: torch.nn.Module) -> None:
    """`train.prefix_sharing` on a model whose attention the shared rows cannot express: ConfigError at start-up."""
    why = unsupported_reason(model) if cfg.train.prefix_sharing else None
    if why is not None:
        raise ConfigError(f"train.prefix_sharing: {why}; set train.prefix_sharing=false")


def build_reference_policy(cfg: DictConfig, loss_fn: PolicyLoss, sync: SyncStrategy, sync_ctx: SyncContext,
                           model: torch.nn.Module, device: torch.device,
                           dist_info: DistInfo | None) -> ReferencePolicy | None:
    """The KL penalty's frozen initial policy when the loss needs one (``loss.kl_reference=initial`` and
    ``loss.kl_coef > 0``), else None. Under LoRA the trained model with its adapter off; otherwise a copy loaded from
    the initial weights (never the checkpoint a run resumes from), with the policy's attention kernel, sharded under
    torchrun as the policy is."""
    if not loss_fn.needs.reference_policy:
        return None
    if sync.uses_lora:  # under FSDP2 through the sharded model's registered log-prob method, as the policy's
        reference = ReferencePolicy.adapter_off(model, fsdp.sharded_token_logprobs(model) if dist_info else None)
    else:
        copy = load_model(str(sync_ctx.model_dir), pick_dtype(cfg.model.dtype, device), device, False)
        set_attention(copy, cfg.model.attn_implementation)
        if dist_info is not None:
            fsdp.shard_model(copy)
        reference = ReferencePolicy.frozen_copy(
            copy, fsdp.sharded_token_logprobs(copy) if dist_info is not None else None)
    log.info("KL reference policy: %r", reference)
    return reference

"""``model.attn_implementation=varlen``: packed rows' attention through FlashAttention's variable-length kernel.

A padding-free micro-batch is one row of several sequences (``grpo.trainer.hidden_states.packed_inputs``). Under SDPA
that row needs an N x N block-diagonal mask (no fused kernel, N^2 memory); FlexAttention keeps it block-sparse but
compiles a block mask per new length. The varlen kernel takes the sequence boundaries (``cu_seq_lens``, cumulative
lengths) and attends within each sequence at flash speed, with no mask and no compile. PyTorch ships that kernel
(``aten._flash_attention_forward/_backward``, the one its nested-tensor SDPA uses), so nothing is installed for it.

Where it runs:
- CUDA, bf16/fp16: the flash varlen kernel, forward and backward (GQA native: K/V keep their own head count).
- elsewhere (CPU, float32): SDPA per sequence, the same result (tests check it against the padded path).
- an unpacked batch (no boundaries given): SDPA with the padding mask, as transformers' ``sdpa`` would.
- a 4D mask (``train.prefix_sharing``'s shared-prompt rows, ``grpo.trainer.prefix``): SDPA with that mask, on any
  device (the flash varlen kernel has no such mask).

The boundaries come as the keyword arguments transformers' attention functions already receive
(``cu_seq_lens_q``, ``max_length_q``), passed by the trainer with the packed row; without them, a single row's
``position_ids`` restarts give them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

NAME = "varlen"


class _FlashVarlen(torch.autograd.Function):
    """Causal attention of packed sequences ``[N, H, D]`` with boundaries ``cu`` through PyTorch's flash kernels."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):  # type: ignore[override]
        # Outputs: out, logsumexp, and the two RNG tensors the backward wants back (dropout is 0, but the op asks).
        # aten operators (what torch.nn.attention.varlen calls), not private attributes; that module's Python API
        # changed between PyTorch releases (is_causal → window_size), the operators' schemas did not.
        out, lse, rng_a, rng_b, _ = torch.ops.aten._flash_attention_forward(  # noqa: SLF001
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_a, rng_b)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, cu, rng_a, rng_b = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(  # noqa: SLF001 (an aten operator)
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_a, rng_b,
            scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None


def boundaries_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seq_lens int32 [S+1], longest)`` of one packed row whose positions restart at 0 per sequence."""
    starts = (position_ids[0] == 0).nonzero().squeeze(1)
    cu = torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _per_sequence_sdpa(q, k, v, cu: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """The exact fallback: causal SDPA on each sequence of ``[1, H, N, D]`` inputs, concatenated back."""
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
            for s, e in zip(bounds[:-1], bounds[1:])]  # fmt: skip
    return torch.cat(outs, dim=2)


def _padded_sdpa(q, k, v, attention_mask: Optional[torch.Tensor], scale: Optional[float]) -> torch.Tensor:
    """Causal SDPA over ``[B, H, T, D]``; a 2D padding mask (as transformers' flash mask gives it) is applied too."""
    gqa = k.shape[1] != q.shape[1]
    if attention_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    max_length_q: Optional[int] = None,
    position_ids: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[B, H, T, D]`` in, ``([B, T, H, D], None)`` out."""
    if sliding_window is not None:
        raise ValueError("model.attn_implementation=varlen does not do sliding-window attention; use sdpa")
    if dropout:
        raise ValueError("model.attn_implementation=varlen has no attention dropout; set the model's to 0")
    if attention_mask is not None and attention_mask.dim() == 4:  # a custom mask (train.prefix_sharing): as given
        gqa = key.shape[1] != query.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2), None
    if cu_seq_lens_q is None and query.shape[0] == 1 and attention_mask is None and position_ids is not None:
        cu_seq_lens_q, max_length_q = boundaries_from_positions(position_ids)
    if cu_seq_lens_q is None:
        return _padded_sdpa(query, key, value, attention_mask, scaling).transpose(1, 2), None
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, H, D]
        cu = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
        max_len = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        return _FlashVarlen.apply(q, k, v, cu, max_len, scaling)[None], None
    return _per_sequence_sdpa(query, key, value, cu_seq_lens_q, scaling).transpose(1, 2), None


def register() -> None:
    """Make ``varlen`` a transformers attention implementation (idempotent). Its mask is FlashAttention's: None,
    or the 2D padding mask of an unpacked batch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    # Eager even inside compiled decoder blocks (model.compile): a graph break around it, as Dynamo would not trace
    # the flash ops' Python-int lengths and custom autograd function cheaply.
    AttentionInterface.register(NAME, torch.compiler.disable(varlen_attention_forward))
    AttentionMaskInterface.register(NAME, flash_attention_mask)

"""The decoder's last hidden states of a micro-batch (no logits), in the layout its forward runs in: padded, packed
into one row without padding (`packed_inputs`), or with each distinct prompt forwarded once (`shared_hidden`,
grpo.trainer.prefix); always returned in the padded ``[B, T, H]`` layout, with the head that maps them to the
vocabulary (grpo.trainer.logprobs takes them from there)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from grpo.trainer.prefix import shared_layout
from grpo.weights.hf_dir import is_peft


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers CausalLM under a PEFT wrapper (LoRA layers are injected in place, so it includes them)."""
    return model.get_base_model() if is_peft(model) else model


def causal_attention_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mask the decoder needs: None when every row is right-padded (ones, then zeros).

    Under causal attention no real token can attend to a pad token after it, so for right padding the mask changes
    nothing at the positions that carry loss; without it SDPA takes its fused causal kernel instead of building a
    ``[B, 1, T, T]`` mask (and, on CPU, keeping the attention weights for backward). Any other layout keeps it.
    """
    if attention_mask is None or attention_mask.shape[1] < 2:
        return None
    return None if bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()) else attention_mask


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(decoder, lm_head)`` of a transformers CausalLM or a PEFT-wrapped one."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings()
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if decoder is None or decoder is lm:
        decoder = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if decoder is None or head is None:
        raise TypeError(f"{type(lm).__name__} exposes no decoder / output embeddings; cannot compute log-probs")
    return decoder, head


def packed_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch as one row without padding: ``(input_ids [1, N], position_ids [1, N])``, N = real tokens.

    Each row's real tokens (``attention_mask == 1``, row-major) follow the previous row's, and the position ids
    restart at 0 with every sequence. transformers reads the restarts as sequence boundaries when no attention
    mask is given (``masking_utils.find_packed_sequence_indices``): SDPA and eager get a block-diagonal causal mask,
    flash-attention its varlen kernel, FlexAttention a document mask; so attention stays within each sequence.
    """
    real = attention_mask.bool()
    position_ids = (attention_mask.long().cumsum(1) - 1)[real]
    return input_ids[real][None], position_ids[None]


def packed_boundaries(attention_mask: torch.Tensor) -> dict:
    """The packed row's sequence boundaries as transformers' attention keyword arguments: ``cu_seq_lens_q/k``
    (int32 cumulative lengths, empty rows dropped) and ``max_length_q/k`` (the longest sequence, a Python int).

    The varlen kernels (``model.attn_implementation=varlen``, flash_attention_2) read them instead of deriving
    them from the position ids in every layer; the other kernels ignore them.
    """
    lengths = attention_mask.sum(1)
    lengths = lengths[lengths > 0]
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max()) if lengths.numel() else 0
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def shared_hidden(
    decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The decoder's last hidden states ``[B, T, H]`` with each prompt forwarded once (``grpo.trainer.prefix``):
    the shared rows run under their 4D mask (taken as given by transformers' sdpa, eager and our varlen kernel),
    then are gathered back to the padded layout; the gather's backward sums the completions' prompt gradients."""
    layout = shared_layout(input_ids, attention_mask, labels)
    dtype = decoder.get_input_embeddings().weight.dtype
    hidden = decoder(input_ids=layout.input_ids, position_ids=layout.position_ids,
                     attention_mask=layout.additive_mask(dtype), use_cache=False).last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1])
    return flat.index_select(0, layout.index.reshape(-1)).view(*input_ids.shape, -1)


def final_hidden(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False,
    labels: Optional[torch.Tensor] = None, shared: bool = False,
) -> tuple[torch.Tensor, nn.Module]:
    """The decoder's last hidden states ``[B, T, H]`` (no logits) and the head that maps them to the vocabulary.

    ``packed``: the decoder runs on the micro-batch packed into one row (``packed_inputs``), so no FLOP goes to
    padding; the hidden states are scattered back to ``[B, T, H]`` (zeros at padding, which carries no label), so
    the log-probs and the loss downstream see the padded layout. ``shared`` (needs ``labels``, which mark where
    each prompt ends): each distinct prompt is forwarded once (``shared_hidden``), the same ``[B, T, H]`` out.
    """
    decoder, head = backbone_and_head(model)
    if shared:
        if labels is None:
            raise ValueError("prefix sharing needs the labels (they mark where each prompt ends)")
        return shared_hidden(decoder, input_ids, attention_mask, labels), head
    if not packed:
        mask = causal_attention_mask(attention_mask)
        return decoder(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state, head
    ids, position_ids = packed_inputs(input_ids, attention_mask)
    hidden = decoder(input_ids=ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                     **packed_boundaries(attention_mask)).last_hidden_state
    real = attention_mask.bool()
    full = hidden.new_zeros(*real.shape, hidden.shape[-1])
    return full.index_put((real,), hidden[0]), head

"""Per-token log-probs of the labels without materialising ``[B, T, vocab]`` float32 logits.

The backbone runs once; the output projection (lm_head) then runs only at positions that carry loss, a chunk of
tokens at a time, with the log-softmax in float32 per chunk. For a plain ``nn.Linear`` head a custom autograd
function keeps nothing per chunk but one float per token and recomputes the chunk's logits in backward, writing the
gradient of the logits in place into that one buffer and accumulating a single weight gradient; any other head (LoRA
on lm_head, quantised) goes through ``torch.utils.checkpoint`` per chunk. Either way forward and backward hold at most one ``[chunk, vocab]`` block.

Given a ``stats`` dict, each path also writes the entropy of every selected token's distribution (``stats["entropy"]``,
``[B, T]`` float32, 0 where IGNORE_INDEX) from the same chunk's logits: one more pass over the chunk in slices of
``ENTROPY_ROWS`` rows, so no second ``[chunk, vocab]`` block. With ``entropy_grad`` the entropies carry their gradient
(an entropy bonus in the loss, ``loss.entropy_coef``): ``dH/dz_j = -p_j (log p_j + H)``, added to the same block in
the backward (or, fused, in the forward).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from grpo.trainer.prefix import shared_layout
from grpo.trainer.train_batch import IGNORE_INDEX
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


def _final_hidden(
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


def _selected_inv_temp(temperatures: Optional[torch.Tensor], sel: torch.Tensor) -> torch.Tensor:
    """``1 / temperature`` of each selected token's sequence (1 when no temperatures are given)."""
    if temperatures is None:
        temperatures = torch.ones(sel.shape[0], device=sel.device)
    return (1.0 / temperatures.float().to(sel.device))[:, None].expand(sel.shape)[sel]


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, bias, inv_temp: torch.Tensor) -> torch.Tensor:
    """float32 logits of one chunk of hidden states, divided by each token's temperature."""
    return F.linear(h, weight, bias).float().mul_(inv_temp[:, None])


# Rows of a chunk's block per entropy slice: the slice's temporary is ENTROPY_ROWS x vocab floats, not the chunk's.
ENTROPY_ROWS = 64


@torch.no_grad()
def block_entropy(block: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each row's distribution from its ``exp(logit - max)`` block and normaliser ``z`` (the row
    sums): ``H = log z - sum(e log e) / z``, since ``log p = log e - log z``. The block is left as it was."""
    s = torch.empty_like(z)
    for r in range(0, block.shape[0], ENTROPY_ROWS):
        rows = block[r : r + ENTROPY_ROWS]
        s[r : r + ENTROPY_ROWS] = torch.xlogy(rows, rows).sum(dim=1)
    return z.log() - s / z


class _LinearLogprob(torch.autograd.Function):
    """``log_softmax(h @ W.T + b) / T)[target]`` over all selected tokens, one chunk of tokens at a time.

    Forward keeps only the log-sum-exp per token. Backward recomputes each chunk's logits, turns that one buffer
    into the gradient of the logits in place, and accumulates the weight gradient into a single ``[V, H]`` buffer
    (``addmm_``), so neither pass holds more than one ``[chunk, V]`` block and one weight-sized gradient. With
    ``with_entropy`` the second output holds each token's entropy (else it is empty); a gradient reaching it (an
    entropy bonus) joins the log-probs' in the same block.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, target, inv_temp, chunk_size, with_entropy):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # an unused output (the entropy of the metric alone) sends None, not zeros
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse = torch.empty_like(out)
        entropy_out = torch.empty_like(out) if with_entropy else out.new_empty(0)
        for s in range(0, h.shape[0], chunk_size):
            sl = slice(s, s + chunk_size)
            logits = _scaled_logits(h[sl], weight, bias, inv_temp[sl])
            picked = logits.gather(1, target[sl, None]).squeeze(1)
            m = logits.max(dim=1).values
            # In place: log-sum-exp without a second [chunk, V] buffer.
            z = logits.sub_(m[:, None]).exp_().sum(dim=1)
            if with_entropy:
                entropy_out[sl] = block_entropy(logits, z)
            lse[sl] = z.log_().add_(m)
            out[sl] = picked - lse[sl]
            del logits  # free this chunk's block before the next one is allocated
        ctx.save_for_backward(h, weight, bias, target, inv_temp, lse, entropy_out)
        ctx.chunk_size = chunk_size
        return out, entropy_out

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):  # type: ignore[override]
        h, weight, bias, target, inv_temp, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if bias is not None and need_b else None
        # d out_i / d rawlogits_i = (onehot(target_i) - softmax_i) / T_i
        g_all = (grad_out.float() if grad_out is not None else torch.zeros_like(lse)) * inv_temp
        g_ent = grad_entropy.float() * inv_temp if grad_entropy is not None and entropy.numel() else None
        ones = torch.ones_like(lse)
        for s in range(0, h.shape[0], ctx.chunk_size):
            sl = slice(s, s + ctx.chunk_size)
            grad = _scaled_logits(h[sl], weight, bias, inv_temp[sl]).sub_(lse[sl, None]).exp_()  # softmax: z = 1
            ent = (g_ent[sl], entropy[sl]) if g_ent is not None else None
            grad = _logit_grad(grad, g_all[sl], ones[sl], target[sl], ent).to(h.dtype)
            if grad_h is not None:
                torch.mm(grad, weight, out=grad_h[sl])
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h[sl])
            if grad_b is not None:
                grad_b.add_(grad.sum(0))
            del grad
        return grad_h, grad_w, grad_b, None, None, None, None


class _FusedLinearLoss(torch.autograd.Function):
    """A token-separable loss of ``log_softmax(h @ W.T + b) / T)[target]`` with its gradient taken in the forward pass.

    Each chunk's logits are computed once: the chunk's log-probs go through the loss (autograd on a ``[B, T]`` leaf,
    cheap next to a ``[chunk, V]`` block) to get ``d loss / d logp`` for those tokens, and the same buffer then
    becomes the gradient of the logits in place, from which the hidden-state and weight gradients follow. That is
    three matmuls per chunk, as many as the naive path, instead of four for recompute-in-backward, with at most one
    ``[chunk, V]`` block alive. It is exact because the loss is token-separable (``LossNeeds.token_separable``):
    token i's gradient depends on token i's log-prob alone, so log-probs of chunks not yet computed cannot change it.
    A loss that is not (``separable=False``: GSPO's sequence ratio) gets every chunk's log-probs first and its
    gradients in a second pass over the chunks.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, target, inv_temp, flat_index, shape, loss_of, chunk_size, out, separable):  # type: ignore[override]
        need_h, need_w, need_b = h.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad
        grads = (torch.empty_like(h) if need_h else None, torch.zeros_like(weight) if need_w else None,
                 torch.zeros_like(bias) if need_b else None)
        full = torch.zeros(shape, dtype=torch.float32, device=h.device)
        flat = full.view(-1)
        entropy = out.get("entropy")
        # The loss's own entropy input (an entropy bonus), or None: the entropies are then a metric alone.
        loss_entropy = entropy if out.get("entropy_grad") else None
        for s in range(0, h.shape[0], chunk_size):
            sl = slice(s, s + chunk_size)
            grad, logprobs, z = _chunk_softmax(h[sl], weight, bias, inv_temp[sl], target[sl])
            flat[flat_index[sl]] = logprobs
            if entropy is not None:  # before the block becomes the gradient in place
                entropy.view(-1)[flat_index[sl]] = block_entropy(grad, z)
            if separable:  # this chunk's gradient needs no later chunk's log-probs: take it now
                g, g_ent = _token_grads(loss_of, full, loss_entropy, flat_index[sl], inv_temp[sl])
                grad = _logit_grad(grad, g, z, target[sl], g_ent).to(h.dtype)  # rebound: the float32 block is freed
                _head_backward(grad, h[sl], weight, grads, sl)
            del grad
        if not separable:
            # A token's gradient depends on other tokens' log-probs (GSPO's sequence ratio): all log-probs first,
            # then a second pass over the chunks (four matmuls per chunk, as the unfused path, one block alive).
            g_all, g_ent_all = _token_grads(loss_of, full, loss_entropy, flat_index, inv_temp)
            for s in range(0, h.shape[0], chunk_size):
                sl = slice(s, s + chunk_size)
                grad, _, z = _chunk_softmax(h[sl], weight, bias, inv_temp[sl], target[sl])
                g_ent = None if g_ent_all is None else (g_ent_all[0][sl], g_ent_all[1][sl])
                grad = _logit_grad(grad, g_all[sl], z, target[sl], g_ent).to(h.dtype)
                _head_backward(grad, h[sl], weight, grads, sl)
                del grad
        loss, metrics = loss_of(full, **({"entropy": loss_entropy} if loss_entropy is not None else {}))
        out["logprobs"], out["metrics"] = full, metrics
        ctx.grads = grads
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        if not bool(grad_loss == 1):  # scaled losses (accumulation weights, FSDP): in place, no second [V, H] copy
            grads = tuple(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return (*grads, None, None, None, None, None, None, None, None)


def _chunk_softmax(h, weight, bias, inv_temp, target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's ``exp(logit - max)`` block (the buffer its gradient is built in), the log-probs of ``target`` and
    the softmax normaliser ``z``."""
    grad = _scaled_logits(h, weight, bias, inv_temp)
    picked = grad.gather(1, target[:, None]).squeeze(1)
    m = grad.max(dim=1).values
    z = grad.sub_(m[:, None]).exp_().sum(dim=1)  # grad now holds exp(logit - max)
    return grad, picked - (z.log() + m), z


def _token_grads(
    loss_of, full: torch.Tensor, entropy: Optional[torch.Tensor], index: torch.Tensor, inv_temp: torch.Tensor
) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """d loss / d logprob at the selected tokens ``index`` (flat into ``[B, T]``) times their inverse temperature,
    from the ``[B, T]`` log-probs ``full`` (each a leaf of its own; no metrics); with the loss's ``entropy`` input,
    also ``(d loss / d entropy times the inverse temperature, the entropies)`` of those tokens, else None."""
    with torch.enable_grad():
        leaves = [full.detach().requires_grad_(True)]
        if entropy is not None:
            leaves.append(entropy.detach().requires_grad_(True))
        kw = {"entropy": leaves[1]} if entropy is not None else {}
        grads = torch.autograd.grad(loss_of(leaves[0], with_metrics=False, **kw)[0], leaves)
    g = grads[0].view(-1)[index] * inv_temp
    if entropy is None:
        return g, None
    return g, (grads[1].view(-1)[index] * inv_temp, entropy.view(-1)[index])


def _logit_grad(
    block: torch.Tensor, g: torch.Tensor, z: torch.Tensor, target: torch.Tensor,
    entropy_grad: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """d loss / d rawlogit = g * (onehot(target) - softmax), in place in the chunk's ``exp(logit - max)`` block, from
    ``g`` = d loss / d logprob times the inverse temperature. ``entropy_grad`` = ``(g_H, H)``, d loss / d entropy
    times the inverse temperature and the entropies, adds ``g_H * dH/dz = -g_H p (log p + H)`` (in slices of
    ``ENTROPY_ROWS`` rows: ``p log p`` is the one temporary)."""
    if entropy_grad is None:
        return block.mul_((-g / z)[:, None]).scatter_add_(1, target[:, None], g[:, None])
    g_ent, entropy = entropy_grad
    # -p (g + g_H H) - g_H p log p, then + g at the target.
    scale = -(g + g_ent * entropy)
    for r in range(0, block.shape[0], ENTROPY_ROWS):
        rows = slice(r, r + ENTROPY_ROWS)
        p = block[rows].div_(z[rows, None])
        p_log_p = torch.xlogy(p, p).mul_(g_ent[rows, None])
        p.mul_(scale[rows, None]).sub_(p_log_p)
        del p_log_p
    return block.scatter_add_(1, target[:, None], g[:, None])


def _head_backward(grad, h, weight, grads, sl) -> None:
    """Adds one chunk's hidden-state, head-weight and bias gradients (``grads``) from its logits' gradient."""
    grad_h, grad_w, grad_b = grads
    if grad_h is not None:
        torch.mm(grad, weight, out=grad_h[sl])
    if grad_w is not None:
        grad_w.addmm_(grad.t(), h)
    if grad_b is not None:
        grad_b.add_(grad.sum(0))


def fused_hidden_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    temperatures: Optional[torch.Tensor],
    loss_of: Callable[[torch.Tensor], tuple[torch.Tensor, dict]],
    chunk_size: int = 512,
    separable: bool = True,
    stats: Optional[dict] = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``loss_of(hidden_logprobs(...))`` from final hidden states ``[B, T, H]`` and a plain ``nn.Linear`` head, with
    the head's backward done chunk by chunk in the forward (``_FusedLinearLoss``); ``stats`` as ``hidden_logprobs``.

    ``loss_of(logprobs, with_metrics=True)`` maps ``[B, T]`` log-probs to ``(scalar loss, metrics)``; with
    ``entropy_grad`` (needs ``stats``) it also takes ``entropy=`` the ``[B, T]`` entropies, and their gradient
    reaches the head and the hidden states as the log-probs' does; ``separable``:
    it is token-separable and is called once per chunk with ``with_metrics=False`` (else once, after every chunk's
    log-probs, and the chunks' logits are computed a second time), and once at the end. Returns
    ``(loss with grad, metrics, detached [B, T] log-probs)``; the loss's backward sends the precomputed gradients
    into ``hidden`` and the head.
    """
    B, T = labels.shape
    _check_entropy_grad(entropy_grad, stats)
    sel = labels != IGNORE_INDEX
    inv_temp = _selected_inv_temp(temperatures, sel)
    flat_index = sel.reshape(-1).nonzero().squeeze(1)
    out: dict = {"entropy_grad": entropy_grad}
    if stats is not None:
        out["entropy"] = stats["entropy"] = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    loss = _FusedLinearLoss.apply(
        hidden[sel], head.weight, head.bias, labels[sel], inv_temp, flat_index, (B, T), loss_of, chunk_size, out,
        separable,
    )
    return loss, out["metrics"], out["logprobs"]


def fused_token_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    temperatures: Optional[torch.Tensor],
    loss_of: Callable[[torch.Tensor], tuple[torch.Tensor, dict]],
    chunk_size: int = 512,
    packed: bool = False,
    shared: bool = False,
    separable: bool = True,
    stats: Optional[dict] = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``loss_of(token_logprobs(...))`` through ``fused_hidden_loss``: the same loss, metrics and gradients, with
    three matmuls per chunk of the output projection instead of four (``separable``, the loss's
    ``LossNeeds.token_separable``; else four, in two passes). Needs ``can_fuse(model)``."""
    hidden, head = _final_hidden(model, input_ids, attention_mask, packed, labels, shared)
    return fused_hidden_loss(hidden, head, labels, temperatures, loss_of, chunk_size, separable, stats, entropy_grad)


def _check_entropy_grad(entropy_grad: bool, stats: Optional[dict]) -> None:
    """The entropies with gradient land in ``stats``: asking for them without it is a caller's error."""
    if entropy_grad and stats is None:
        raise ValueError("entropy_grad=True needs a stats dict to receive the entropies")


def can_fuse(model: nn.Module) -> bool:
    """Whether ``fused_token_loss`` applies: a plain ``nn.Linear`` head (any loss: a token-separable one in one pass,
    another in two, as its ``LossNeeds.token_separable`` says)."""
    return type(backbone_and_head(model)[1]) is nn.Linear


def _module_chunk(
    head: nn.Module, h: torch.Tensor, target: torch.Tensor, inv_temp: torch.Tensor, with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One chunk's log-probs of ``target`` through any head module, and its entropies if asked (with gradient when
    ``entropy_grad``: autograd then keeps the chunk's log-softmax for the checkpoint's recompute)."""
    logits = head(h).float() * inv_temp[:, None]
    lse = torch.logsumexp(logits, dim=-1)
    entropy = None
    if entropy_grad:
        log_p = logits - lse[:, None]
        entropy = -(log_p.exp() * log_p).sum(dim=1)
    elif with_entropy:  # the probabilities are their own normalised block (z = 1)
        with torch.no_grad():
            entropy = block_entropy((logits - lse[:, None]).exp(), torch.ones_like(lse))
    return logits.gather(1, target[:, None]).squeeze(1) - lse, entropy


def hidden_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    temperatures: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    fused: Optional[bool] = None,
    stats: Optional[dict] = None,
    entropy_grad: bool = False,
) -> torch.Tensor:
    """Log-probs of ``labels`` (``[B, T]``, IGNORE_INDEX = skip → 0) from final hidden states ``[B, T, H]`` and the head.

    ``fused`` picks the custom autograd path (plain ``nn.Linear`` heads only; default: whenever possible) or
    per-chunk checkpointing of ``head`` (any module). ``stats``, a dict, receives ``"entropy"``: each selected
    token's entropy at its temperature (``[B, T]``), from the same chunks' logits; without gradient unless
    ``entropy_grad`` (an entropy bonus in the loss).
    """
    B, T = labels.shape
    _check_entropy_grad(entropy_grad, stats)
    out = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    sel = labels != IGNORE_INDEX
    if stats is not None:
        stats["entropy"] = torch.zeros_like(out)
    if not bool(sel.any()):
        # Keep the graph connected so backward() on a loss built from this still works.
        return out + 0.0 * hidden.sum()
    inv_temp = _selected_inv_temp(temperatures, sel)
    h = hidden[sel]
    target = labels[sel]
    if fused is None:
        fused = type(head) is nn.Linear
    if fused:
        logprobs, entropy = _LinearLogprob.apply(h, head.weight, head.bias, target, inv_temp, chunk_size, stats is not None)
    else:
        parts, entropies = [], []
        for s in range(0, h.shape[0], chunk_size):
            sl = slice(s, s + chunk_size)
            args = (head, h[sl], target[sl], inv_temp[sl], stats is not None, entropy_grad)
            if torch.is_grad_enabled():
                lp, ent = checkpoint(_module_chunk, *args, use_reentrant=False)
            else:
                lp, ent = _module_chunk(*args)
            parts.append(lp)
            entropies.append(ent)
        logprobs = torch.cat(parts)
        entropy = torch.cat(entropies) if stats is not None else None
    if stats is not None:
        if not entropy_grad:  # a metric alone: nothing of the graph kept for it
            entropy = entropy.detach()
        stats["entropy"] = stats["entropy"].masked_scatter(sel, entropy)
    return out.masked_scatter(sel, logprobs)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    temperatures: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    packed: bool = False,
    shared: bool = False,
    stats: Optional[dict] = None,
    entropy_grad: bool = False,
) -> torch.Tensor:
    """``[B, T]`` float32 log-probs of ``labels`` under ``model`` at per-sequence ``temperatures`` (0 where IGNORE_INDEX).

    Logits are divided by the sequence's sampling temperature before the softmax, so the log-probs are those of the
    distribution the rollout was sampled from. Works for transformers CausalLMs and PEFT-wrapped ones. ``packed``
    runs the decoder padding-free (``packed_inputs``), ``shared`` with each prompt forwarded once
    (``grpo.trainer.prefix``); either way the result is the same ``[B, T]`` tensor. ``stats``, ``entropy_grad``: as
    ``hidden_logprobs``.
    """
    hidden, head = _final_hidden(model, input_ids, attention_mask, packed, labels, shared)
    return hidden_logprobs(hidden, head, labels, temperatures, chunk_size, stats=stats, entropy_grad=entropy_grad)


def _naive_scaled_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperatures: Optional[torch.Tensor]
) -> torch.Tensor:
    """The naive references' full ``[B, T, vocab]`` float32 logits, divided by each sequence's temperature."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    if temperatures is not None:
        logits = logits / temperatures.float()[:, None, None]
    return logits


def naive_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    temperatures: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference implementation: full ``[B, T, vocab]`` float32 logits (tests and benchmarks only)."""
    logits = _naive_scaled_logits(model, input_ids, attention_mask, temperatures)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(labels != IGNORE_INDEX, lp, torch.zeros_like(lp))


def naive_token_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    temperatures: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference for ``stats["entropy"]``: each token's entropy from full ``[B, T, vocab]`` float32 logits at its
    temperature, 0 where IGNORE_INDEX, with gradient when grad is enabled (tests and benchmarks only)."""
    logits = _naive_scaled_logits(model, input_ids, attention_mask, temperatures)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    return torch.where(labels != IGNORE_INDEX, entropy, torch.zeros_like(entropy))

"""Chunked log-probs equal the naive full-logits computation (values and gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo.trainer.logprobs import hidden_logprobs, naive_token_entropy, naive_token_logprobs, token_logprobs

ATOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)


def _batch(vocab, B=3, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[:, :6] = -100  # prompt
    attn[1, 17:] = 0  # right padding
    labels[1, 17:] = -100
    labels[2, 10] = -100  # a hole inside the completion
    return ids, attn, labels


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model, ids, attn, labels, temps, chunk):
    model.zero_grad()
    w = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))  # arbitrary upstream gradient
    fast = token_logprobs(model, ids, attn, labels, temps, chunk_size=chunk)
    (fast * w).sum().backward()
    g_fast = _grads(model)
    model.zero_grad()
    slow = naive_token_logprobs(model, ids, attn, labels, temps)
    (slow * w).sum().backward()
    g_slow = _grads(model)
    model.zero_grad()
    assert fast.dtype == torch.float32 and fast.shape == labels.shape
    torch.testing.assert_close(fast, slow, atol=ATOL, rtol=0)
    assert (fast[labels == -100] == 0).all()
    assert g_fast.keys() == g_slow.keys() and g_fast
    for name in g_fast:
        torch.testing.assert_close(g_fast[name], g_slow[name], atol=ATOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("chunk", [5, 1024])
def test_matches_naive(model, chunk):
    ids, attn, labels = _batch(model.config.vocab_size)
    _compare(model, ids, attn, labels, torch.ones(3), chunk)


def test_matches_naive_with_temperatures(model):
    ids, attn, labels = _batch(model.config.vocab_size, seed=3)
    _compare(model, ids, attn, labels, torch.tensor([0.7, 1.0, 1.6]), 7)


def test_peft_model_matches_naive(tiny_qwen2_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    # Non-zero B so the adapter changes the output and gets a real gradient.
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids, attn, labels = _batch(base.config.vocab_size, seed=4)
    _compare(peft_model, ids, attn, labels, torch.tensor([1.0, 0.8, 1.2]), 9)


def _head_case() -> tuple[nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A small head on random hidden states: (head, hidden [2, 9, 16], labels with a prompt, temperatures)."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=True)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = -100
    return head, hidden, labels, torch.tensor([0.5, 2.0])


def test_module_head_checkpoint_path_matches_fused():
    """A head that is not a plain Linear (e.g. LoRA on lm_head) goes through per-chunk checkpointing."""
    head, hidden, labels, temps = _head_case()
    outs, grads = [], []
    for fused in (True, False):
        hidden.grad = None
        head.zero_grad()
        out = hidden_logprobs(hidden, head, labels, temps, chunk_size=4, fused=fused)
        out.sum().backward()
        outs.append(out)
        grads.append((hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()))
    ref = torch.log_softmax(head(hidden) / temps[:, None, None], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ref = torch.where(labels == -100, torch.zeros_like(ref), ref)
    torch.testing.assert_close(outs[0], ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[1], ref, atol=ATOL, rtol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_no_labels_keeps_graph(model):
    ids, attn, labels = _batch(model.config.vocab_size)
    out = token_logprobs(model, ids, attn, torch.full_like(labels, -100), torch.ones(3))
    assert (out == 0).all()
    out.sum().backward()  # must not raise
    model.zero_grad()


def test_no_grad_mode(model):
    ids, attn, labels = _batch(model.config.vocab_size)
    with torch.no_grad():
        a = token_logprobs(model, ids, attn, labels, torch.ones(3), chunk_size=8)
        b = naive_token_logprobs(model, ids, attn, labels, torch.ones(3))
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_right_padding_drops_the_mask_left_padding_keeps_it(model):
    from grpo.trainer.hidden_states import causal_attention_mask

    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert causal_attention_mask(right) is None  # the causal mask alone is exact for right padding
    assert causal_attention_mask(left) is left
    # Left padding (mask kept) still matches the naive computation.
    ids, attn, labels = _batch(model.config.vocab_size)
    attn = torch.ones_like(attn)
    attn[1, :4] = 0
    labels[1, :6] = -100
    _compare(model, ids, attn, labels, torch.ones(3), 5)


def _naive_entropy(head, hidden, labels, temps):
    logits = head(hidden).float() / temps[:, None, None]
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    return torch.where(labels == -100, torch.zeros_like(ent), ent)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk", [4, 1024])
def test_entropy_of_each_token_matches_the_full_softmax(fused, chunk, monkeypatch):
    """`stats["entropy"]`: each selected token's entropy at its temperature, from the fused path's in-place blocks
    (sliced by ENTROPY_ROWS, set below a chunk here) and from the module path's checkpointed chunks; the log-probs and
    their gradients do not change when it is asked for."""
    import grpo.trainer.logprobs as logprobs

    monkeypatch.setattr(logprobs, "ENTROPY_ROWS", 3)
    head, hidden, labels, temps = _head_case()
    results = []
    for stats in ({}, None):
        hidden.grad = None
        out = hidden_logprobs(hidden, head, labels, temps, chunk_size=chunk, fused=fused, stats=stats)
        out.sum().backward()
        results.append((out.detach(), hidden.grad.clone(), stats))
    (lp, grad, stats), (lp_plain, grad_plain, _) = results
    torch.testing.assert_close(lp, lp_plain, atol=0, rtol=0)
    torch.testing.assert_close(grad, grad_plain, atol=0, rtol=0)
    want = _naive_entropy(head, hidden.detach(), labels, temps)
    assert not stats["entropy"].requires_grad
    torch.testing.assert_close(stats["entropy"], want, atol=1e-5, rtol=0)
    assert (stats["entropy"][labels != -100] > 0).all()


def test_entropy_of_a_uniform_head_is_log_vocab():
    """A zero head gives every token the uniform distribution over the vocabulary: entropy exactly log V."""
    head = nn.Linear(8, 37, bias=False)
    nn.init.zeros_(head.weight)
    labels = torch.randint(0, 37, (2, 5))
    stats: dict = {}
    hidden_logprobs(torch.randn(2, 5, 8), head, labels, torch.tensor([1.0, 0.3]), chunk_size=3, stats=stats)
    torch.testing.assert_close(stats["entropy"], torch.full((2, 5), float(torch.log(torch.tensor(37.0)))))


def test_entropy_through_the_model_with_prefix_sharing(model):
    """token_logprobs passes `stats` down whatever the decoder's layout (here each prompt forwarded once)."""
    ids, attn, labels = _batch(model.config.vocab_size)
    ids[1, :6] = ids[0, :6]  # two rows share a prompt
    stats: dict = {}
    with torch.no_grad():
        token_logprobs(model, ids, attn, labels, torch.ones(3), chunk_size=8, shared=True, stats=stats)
    want = naive_token_entropy(model, ids, attn, labels)
    torch.testing.assert_close(stats["entropy"], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk", [4, 1024])
def test_entropy_gradient_matches_the_full_softmax(fused, chunk, monkeypatch):
    """With `entropy_grad` the entropies carry their gradient (an entropy bonus): a loss mixing log-probs and
    entropies gives the hidden states, the head's weight and bias the gradients of autograd through the full
    softmax, on the fused path (its backward adds -g_H p (log p + H) in ENTROPY_ROWS slices) and the module path."""
    import grpo.trainer.logprobs as logprobs

    monkeypatch.setattr(logprobs, "ENTROPY_ROWS", 3)
    head, hidden, labels, temps = _head_case()
    w_lp, w_ent = torch.randn(2, 9), torch.randn(2, 9)  # both signs, as advantages and a bonus give

    def grads(lp, ent):
        hidden.grad = None
        head.zero_grad()
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()

    stats: dict = {}
    lp = hidden_logprobs(hidden, head, labels, temps, chunk_size=chunk, fused=fused, stats=stats, entropy_grad=True)
    got = grads(lp, stats["entropy"])
    ref_lp = torch.log_softmax(head(hidden) / temps[:, None, None], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ref_lp = torch.where(labels == -100, torch.zeros_like(ref_lp), ref_lp)
    want = grads(ref_lp, _naive_entropy(head, hidden, labels, temps))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    # The entropy term does reach the gradients: without it they differ.
    stats = {}
    lp = hidden_logprobs(hidden, head, labels, temps, chunk_size=chunk, fused=fused, stats=stats)
    without = grads(lp, torch.zeros_like(lp))
    assert (without[1] - want[1]).abs().max() > 1e-3


def test_entropy_grad_needs_stats():
    head, hidden, labels, temps = _head_case()
    with pytest.raises(ValueError, match="needs a stats dict"):
        hidden_logprobs(hidden, head, labels, temps, entropy_grad=True)


def test_steps_along_the_entropy_gradient_raise_the_entropy():
    """Gradient ascent on the fused path's entropy (a bonus alone, no advantage) flattens the head's distributions."""
    head, hidden, labels, temps = _head_case()
    hidden = hidden.detach()
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    mask = (labels != -100).float()
    means = []
    for _ in range(5):
        stats: dict = {}
        hidden_logprobs(hidden, head, labels, temps, chunk_size=4, stats=stats, entropy_grad=True)
        mean = (stats["entropy"] * mask).sum() / mask.sum()
        means.append(float(mean.detach()))
        opt.zero_grad()
        (-mean).backward()
        opt.step()
    assert all(b > a for a, b in zip(means, means[1:])), means
    assert means[-1] < float(torch.log(torch.tensor(50.0)))  # bounded by the uniform distribution's log V

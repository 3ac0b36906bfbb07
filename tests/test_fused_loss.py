"""The fused log-prob + loss path equals log-probs → loss → backward through autograd (value, metrics, gradients)."""

from __future__ import annotations

import pytest
import torch

from grpo.algorithms.aggregation import Totals
from grpo.trainer.logprobs import can_fuse, fused_token_loss, naive_token_entropy, naive_token_logprobs
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.loss_interface import LossInputs


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)


def _inputs(model, B=4, T=20, seed=0):
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[:, :5] = -100  # prompt
    attn[1, 15:] = 0  # right padding
    labels[1, 15:] = -100
    labels[2, 9] = -100  # a hole inside the completion
    mask = (labels != -100).float()
    with torch.no_grad():
        lp = naive_token_logprobs(model, ids, attn, labels)
    # Rollout log-probs off by up to ±0.6 nats, so ratios land on both sides of every clip bound; two missing.
    rollout = torch.where(mask > 0, lp + (torch.rand(B, T, generator=g) - 0.5) * 1.2, torch.ones(B, T))
    rollout[0, 7] = float("nan")
    rollout[3, 12] = float("nan")
    ref = torch.where(mask > 0, lp + (torch.rand(B, T, generator=g) - 0.5) * 0.4, torch.full((B, T), float("nan")))
    adv = torch.tensor([1.3, -0.7, 0.4, -1.5])  # both signs
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3])
    return ids, attn, labels, mask, rollout, ref, adv, temps


LOSSES = {
    "grpo": dict(),
    "dapo_clip_higher": dict(clip_eps=0.2, clip_eps_high=0.28),
    "dual_clip": dict(dual_clip=1.5),
    "tis": dict(tis_cap=1.2),
    "kl_k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "kl_k2": dict(kl_coef=0.05, kl_estimator="k2"),
    "seq_mean_token_mean": dict(aggregation="seq_mean_token_mean"),
    "dr_grpo": dict(aggregation="seq_mean_token_sum_norm"),
    "dr_grpo_fixed_norm": dict(aggregation="seq_mean_token_sum_norm", max_tokens_norm=32),
    # Off-policy masks: the token band is token-separable, the sequence band on the current log-probs is not (the
    # fused path's two passes).
    "token_mask": dict(token_mask=[0.8, 1.25]),
    "sequence_mask": dict(sequence_mask=[0.97, 1.03], aggregation="seq_mean_token_mean"),
    "gspo": dict(objective="gspo", clip_eps=0.01, clip_eps_high=0.02, aggregation="seq_mean_token_mean"),
    "cispo": dict(objective="cispo", clip_eps=1.0, clip_eps_high=0.28),
}


def _loss(name: str, **extra):
    return GRPOLoss(**LOSSES[name], **extra)


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("chunk", [3, 1024])
@pytest.mark.parametrize("name", list(LOSSES))
def test_fused_equals_unfused(model, name, chunk):
    ids, attn, labels, mask, rollout, ref, adv, temps = _inputs(model)
    loss_fn = _loss(name)
    # Normalisers of a bigger optimizer step, as under gradient accumulation.
    kw = dict(ref_logprobs=ref, totals=Totals(tokens=71.0, sequences=6.0, max_tokens=17.0))

    def loss_of(lp, with_metrics=True):
        return loss_fn(LossInputs(lp, rollout, adv, mask, **kw), with_metrics=with_metrics)

    model.zero_grad(set_to_none=True)
    lp = naive_token_logprobs(model, ids, attn, labels, temps)
    ref_loss, ref_metrics = loss_of(lp)
    (ref_loss * 3.0).backward()  # a scale on the loss (FSDP world size, accumulation) reaches every gradient
    want = _grads(model)

    stats: dict = {}
    loss, metrics, fused_lp = fused_token_loss(model, ids, attn, labels, temps, loss_of, chunk_size=chunk,
                                               separable=loss_fn.needs.token_separable, stats=stats)
    (loss * 3.0).backward()
    got = _grads(model)

    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused_lp, lp.detach(), atol=1e-5, rtol=0)
    assert metrics.keys() == ref_metrics.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-5), k
    # The inputs do exercise the clip (TIS clips its weight instead: its PPO ratio is 1 by construction).
    acted = {"tis": "grpo/tis_capped", "token_mask": "mismatch/masked_fraction",
             "sequence_mask": "mismatch/masked_sequences"}.get(name, "grpo/clipped_fraction")
    assert ref_metrics[acted] > 0
    assert got.keys() == want.keys() and len(got) > 5
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=n)
    # The tokens' entropies, taken from the blocks before they became gradients in place.
    torch.testing.assert_close(stats["entropy"], naive_token_entropy(model, ids, attn, labels, temps), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [3, 1024])
@pytest.mark.parametrize("name", ["grpo", "seq_mean_token_mean", "gspo"])
def test_entropy_bonus_fused_equals_unfused(model, name, chunk):
    """`loss.entropy_coef`: the fused path takes the bonus's gradient with the log-probs' (both per chunk, or in the
    second pass of a loss that is not token-separable: GSPO) and gives the loss, metrics and gradients of autograd
    through full logits; the bonus moves the gradients."""
    ids, attn, labels, mask, rollout, ref, adv, temps = _inputs(model)
    loss_fn = _loss(name, entropy_coef=0.05)
    assert loss_fn.needs.entropy and not loss_fn.needs.zero_advantage_adds_nothing
    kw = dict(ref_logprobs=ref, totals=Totals(tokens=71.0, sequences=6.0, max_tokens=17.0))

    def loss_of(lp, with_metrics=True, entropy=None):
        return loss_fn(LossInputs(lp, rollout, adv, mask, entropy=entropy, **kw), with_metrics=with_metrics)

    model.zero_grad(set_to_none=True)
    ref_loss, ref_metrics = loss_of(naive_token_logprobs(model, ids, attn, labels, temps),
                                    entropy=naive_token_entropy(model, ids, attn, labels, temps))
    ref_loss.backward()
    want = _grads(model)

    stats: dict = {}
    loss, metrics, _ = fused_token_loss(model, ids, attn, labels, temps, loss_of, chunk_size=chunk,
                                        separable=loss_fn.needs.token_separable, stats=stats, entropy_grad=True)
    loss.backward()
    got = _grads(model)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=1e-5)
    for k in metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-5), k
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=n)

    plain_fn = _loss(name)
    fused_token_loss(model, ids, attn, labels, temps,
                     lambda lp, with_metrics=True: plain_fn(LossInputs(lp, rollout, adv, mask, **kw), with_metrics),
                     chunk_size=chunk, separable=plain_fn.needs.token_separable)[0].backward()
    head = "lm_head.weight" if "lm_head.weight" in want else max(want, key=lambda n: want[n].numel())
    assert (_grads(model)[head] - want[head]).abs().max() > 1e-6


def test_fused_without_loss_tokens_keeps_graph(model):
    ids, attn, labels, mask, rollout, ref, adv, temps = _inputs(model)
    labels = torch.full_like(labels, -100)
    mask = torch.zeros_like(mask)
    loss, metrics, lp = fused_token_loss(model, ids, attn, labels, None, lambda x, with_metrics=True: GRPOLoss()(LossInputs(x, rollout, adv, mask), with_metrics))
    loss.backward()
    grads = _grads(model)
    assert float(loss.detach()) == 0.0 and (lp == 0).all() and metrics["grpo/tokens"] == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in grads.values())


def test_can_fuse_needs_a_linear_head_and_the_loss_declares_its_separability(model, tiny_qwen2_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    assert can_fuse(model)
    assert GRPOLoss().needs.token_separable and GRPOLoss(objective="cispo").needs.token_separable
    assert not GRPOLoss(objective="gspo").needs.token_separable  # a sequence's ratio: two passes
    assert not GRPOLoss(sequence_mask=[0.5, 2.0]).needs.token_separable
    assert GRPOLoss(sequence_mask=[0.5, 2.0], old_logprobs="recompute").needs.token_separable  # pi_old is a constant
    lora_head = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32),
        LoraConfig(r=2, target_modules=["lm_head", "q_proj"]),
    )
    assert not can_fuse(lora_head)  # LoRA on lm_head: the checkpointed per-chunk path instead
    assert can_fuse(get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32), LoraConfig(r=2, target_modules=["q_proj"])
    ))

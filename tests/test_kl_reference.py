"""loss.kl_reference=initial: GRPO's KL penalty against the frozen initial policy (grpo.trainer.reference), computed
once per rollout batch; a frozen copy of the initial weights, or the LoRA base with the adapter off; built from the
initial weights also on resume; through train.py on the real CPU engine. FSDP2: tests/test_distributed.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import attach
from grpo.config_values import ConfigError
from grpo.pipeline.batching import prepare_batch
from grpo.recipes.trainable_model import build_reference_policy
from grpo.schema import LoggingConfig, LoraConfig, TrainConfig
from grpo.trainer.checkpoint import CheckpointManager
from grpo.trainer.layers import apply_lora
from grpo.trainer.logprobs import token_logprobs
from grpo.trainer.loop import GRPOTrainer
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.loss_interface import LossInputs
from grpo.trainer.metrics import MetricsLogger
from grpo.trainer.optim import build_scheduler
from grpo.trainer.reference import ReferencePolicy
from grpo.trainer.train_batch import IGNORE_INDEX
from test_packing import _groups, _model, update_trainer
from test_ppo_updates import _Groups, _NoServer
from test_train_e2e import QUICK, assert_clean, metrics, run_train


def _moved(model_dir, seed: int = 1, scale: float = 0.05):
    """The tiny model with every weight moved by seeded noise: a policy some updates away from its initial weights."""
    model = _model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def _per_sequence(batch, field: str) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Each sequence's labels and `field` at its labelled positions, sorted by labels (layouts order rows apart)."""
    out = []
    for mb in batch.micro_batches:
        for r in range(mb.num_sequences):
            keep = mb.labels[r] != IGNORE_INDEX
            out.append((tuple(mb.labels[r][keep].tolist()), getattr(mb, field)[r][keep]))
    return sorted(out, key=lambda x: x[0])


def test_the_loss_asks_for_the_initial_policy_only_while_the_penalty_is_on():
    assert GRPOLoss(kl_coef=0.1).needs.reference_policy  # the default reference: the initial weights
    assert not GRPOLoss().needs.reference_policy
    assert not GRPOLoss(kl_coef=0.1, kl_reference="rollout").needs.reference_policy
    with pytest.raises(ValueError, match="kl_reference must be one of"):
        GRPOLoss(kl_coef=0.1, kl_reference="sft")
    logp, mask, adv = torch.full((1, 3), -1.0), torch.ones(1, 3), torch.zeros(1)
    # Without the reference's log-probs the penalty is not quietly measured against the rollouts.
    with pytest.raises(ValueError, match="initial policy's log-probs"):
        GRPOLoss(kl_coef=0.1)(LossInputs(logp, logp - 0.5, adv, mask))
    _, m = GRPOLoss(kl_coef=0.1)(LossInputs(logp, logp - 0.5, adv, mask, ref_logprobs=logp - 0.2))
    assert m["grpo/kl"] == pytest.approx(torch.expm1(torch.tensor(-0.2)).item() + 0.2, rel=1e-5)  # k3 at x = -0.2


def test_a_trainer_is_refused_without_the_reference_its_loss_needs(tiny_qwen2_dir):
    with pytest.raises(ConfigError, match="against the initial policy"):
        update_trainer(_model(tiny_qwen2_dir), GRPOLoss(kl_coef=0.1))


@pytest.mark.parametrize("layout", [{}, {"padding_free": True}, {"prefix_sharing": True},
                                    {"max_tokens_per_micro_batch": 40, "padding_free": True}],
                         ids=["padded", "packed", "prefix_shared", "token_budget"])
def test_reference_log_probs_are_the_initial_weights_in_every_layout(tiny_qwen2_dir, layout):
    """The reference forward runs in the trainer's layout (packed rows, shared prompts, re-split micro-batches) and
    gives the initial model's log-probs, not the moved policy's; it trains nothing."""
    policy = _moved(tiny_qwen2_dir)
    reference = ReferencePolicy.frozen_copy(_model(tiny_qwen2_dir))
    trainer = update_trainer(policy, GRPOLoss(kl_coef=0.1), reference=reference, **layout)
    batch = prepare_batch(_groups(0), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    ((_, mini),) = trainer.plan(batch)
    trainer.reference_logprobs(mini)
    initial = _model(tiny_qwen2_dir)
    for mb in batch.micro_batches:  # the plain padded forward of the initial weights
        mb.old_logprobs = token_logprobs(initial, mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures).detach()
    got, want = _per_sequence(mini, "ref_logprobs"), _per_sequence(batch, "old_logprobs")
    assert [labels for labels, _ in got] == [labels for labels, _ in want]
    for (_, g), (_, w) in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    _, step_metrics = trainer.forward_backward(mini)
    assert step_metrics["grpo/kl"] > 1e-3  # the moved policy is measured against the initial weights
    assert all(p.grad is None and not p.requires_grad for p in reference.model.parameters())


def test_lora_reference_is_the_base_model_with_the_adapter_off(tiny_qwen2_dir):
    """No second copy under LoRA: the trained model computes pi_ref with its adapter disabled, then trains on."""
    peft_model = apply_lora(_model(tiny_qwen2_dir), OmegaConf.structured(LoraConfig(r=4, alpha=8)), [0, 1])
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at 0 (the adapter adds nothing): give it weights, as training would
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    batch = prepare_batch(_groups(1), max_seq_len=64, micro_batch_size=12, pad_token_id=0).micro_batches[0]
    args = (batch.input_ids, batch.attention_mask, batch.labels, batch.temperatures)
    mask = batch.labels != IGNORE_INDEX
    policy_before = token_logprobs(peft_model, *args).detach()
    ref = ReferencePolicy.adapter_off(peft_model).logprobs(*args)
    torch.testing.assert_close(ref, token_logprobs(_model(tiny_qwen2_dir), *args).detach(), rtol=0, atol=1e-5)
    assert (ref - policy_before)[mask].abs().max() > 1e-3
    torch.testing.assert_close(token_logprobs(peft_model, *args).detach(), policy_before, rtol=0, atol=0)  # adapter on


def test_build_reference_policy_loads_the_initial_weights_also_on_resume(tiny_qwen2_dir):
    """A resumed policy starts from its checkpoint; the reference still comes from the initial model directory.
    None when the loss needs no reference; under LoRA the trained model itself."""
    cfg = OmegaConf.create({"model": {"dtype": "float32", "attn_implementation": None}})
    ctx = SimpleNamespace(model_dir=Path(tiny_qwen2_dir))
    full, cpu = SimpleNamespace(uses_lora=False), torch.device("cpu")
    policy = _moved(tiny_qwen2_dir)  # as a resumed run's weights
    reference = build_reference_policy(cfg, GRPOLoss(kl_coef=0.1), full, ctx, policy, cpu, None)
    initial = dict(_model(tiny_qwen2_dir).named_parameters())
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(p, initial[name], rtol=0, atol=0, msg=name)
        assert not p.requires_grad
    assert reference.model is not policy
    for loss in (GRPOLoss(), GRPOLoss(kl_coef=0.1, kl_reference="rollout")):
        assert build_reference_policy(cfg, loss, full, ctx, policy, cpu, None) is None
    peft_model = apply_lora(_model(tiny_qwen2_dir), OmegaConf.structured(LoraConfig(r=4, alpha=8)), [0, 1])
    lora = build_reference_policy(cfg, GRPOLoss(kl_coef=0.1), SimpleNamespace(uses_lora=True), ctx, peft_model, cpu,
                                  None)
    assert lora.model is peft_model and lora.shares_policy_weights


class _EqualScores(_Groups):
    """The same scripted groups at every step, their samples scoring alike: advantage 0, so the KL penalty is the
    whole loss."""

    def next_groups(self, step):
        return [dataclasses.replace(g, scores=[1.0] * len(g.scores)) for g in super().next_groups(0)]


def test_the_penalty_pulls_a_moved_policy_back_to_its_initial_weights(tiny_qwen2_dir, tmp_path):
    """A policy some way from its initial weights, trained on groups that teach nothing else: each step's KL is
    measured against the initial weights (not the policy itself, nor the scripted rollout log-probs) and the penalty's
    gradient brings it down."""
    steps, run_dir = 4, tmp_path / "run"
    run_dir.mkdir()
    policy = _moved(tiny_qwen2_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
    cfg = OmegaConf.structured(TrainConfig(steps=steps, micro_batch_size=2, grad_accum=4, checkpoint_every=steps))
    trainer = GRPOTrainer(
        train_cfg=cfg, model=policy, tokenizer=None, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, "constant", 0, steps), loss_fn=GRPOLoss(kl_coef=1.0),
        pipeline=_EqualScores(0, cfg.micro_batch_size), sync=_NoServer(), checkpoints=CheckpointManager(run_dir),
        metrics=MetricsLogger(run_dir, OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False)), cfg,
                              steps, 0),
        device=torch.device("cpu"), reference=ReferencePolicy.frozen_copy(_model(tiny_qwen2_dir)))
    trainer.save_checkpoint = lambda: None  # checkpoints are not what this test is about (the tokenizer is None)
    trainer.fit()
    trainer.metrics.close()
    rows = metrics(run_dir)
    kl = [r["grpo/kl"] for r in rows]
    assert kl[0] > 0.1 and kl[-1] < 0.25 * kl[0], kl
    assert all(r["time/ref_logprobs_seconds"] > 0 for r in rows)


@pytest.mark.slow
def test_train_py_with_the_penalty_builds_the_reference_and_logs_it(tmp_path, train_server, tiny_qwen2_dir):
    """The whole run on the real CPU engine: the reference built from the initial weights, its forward timed, the
    KL 0 at the first update and positive after."""
    run_dir = tmp_path / "run"
    external, env = attach(train_server, tiny_qwen2_dir)
    out, marker = run_train(*QUICK, "train.steps=3", "loss.kl_coef=0.1", "optimizer.lr=3e-3", external,
                            f"hydra.run.dir={run_dir}", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    assert "KL reference policy: ReferencePolicy(a frozen copy)" in out.stderr + out.stdout
    rows = [r for r in metrics(run_dir) if "grpo/kl" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["grpo/kl"]) < 1e-6 and rows[-1]["grpo/kl"] > 0
    assert all(r["time/ref_logprobs_seconds"] > 0 for r in rows)

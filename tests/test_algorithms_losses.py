"""GSPO, CISPO (``loss.objective``), the off-policy masks and the mismatch metric, on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithms.policy import POLICY_OBJECTIVES, ClipRange
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.loss_interface import LossInputs

F64 = torch.float64


def _log_ratios():
    # Three sequences; the third has a padded last position (mask 0) whose log-ratio must not count.
    log_ratio = torch.tensor([[0.10, -0.02, 0.04, 0.00],
                              [0.30, 0.20, 0.10, 0.00],
                              [-0.01, 0.01, 0.03, 5.00]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=F64)
    return log_ratio, mask


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios():
    log_ratio, mask = _log_ratios()
    adv = torch.ones_like(log_ratio)
    out = POLICY_OBJECTIVES.get("gspo", "k")(log_ratio, adv, mask, ClipRange(10.0, 10.0))
    want = [math.exp(0.12 / 4), math.exp(0.60 / 4), math.exp(0.03 / 3)]  # exp(mean token log-ratio) per sequence
    for i, w in enumerate(want):
        assert out.ratio[i, :].tolist() == pytest.approx([w] * 4)  # the same ratio at every token of the sequence


def test_gspo_gradient_is_zero_exactly_for_the_clipped_sequences():
    log_ratio, mask = _log_ratios()
    log_ratio.requires_grad_()
    # Sequence ratios 1.030, 1.162, 1.010; clip [0.95, 1.05]: sequence 1 is clipped for A > 0 (ratio above 1.05),
    # sequence 0 is inside, sequence 2 (A < 0) is inside.
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=F64)[:, None].expand_as(log_ratio)
    out = POLICY_OBJECTIVES.get("gspo", "k")(log_ratio, adv, mask, ClipRange(0.05, 0.05))
    (out.objective * mask).sum().backward()
    g = log_ratio.grad
    assert (g[1] == 0).all()  # clipped sequence: no gradient at any token
    assert (g[0] != 0).all() and (g[2, :3] != 0).all()
    # Each token of an unclipped sequence gets 1/|y| of d(s A)/d(mean log-ratio) per token summed: s_i A_i.
    assert g[0].tolist() == pytest.approx([math.exp(0.03)] * 4)
    assert g[2, :3].tolist() == pytest.approx([-math.exp(0.01)] * 3)
    assert g[2, 3] == 0  # the padded position


def test_gspo_loss_clips_what_a_token_ratio_would_not():
    """Token ratios inside [0.8, 1.2] whose geometric mean is outside [1 - 3e-4, 1 + 4e-4]: GRPO trains the sequence,
    GSPO with the paper's range clips it (no gradient)."""
    rollout = torch.zeros(1, 3)
    lp = torch.tensor([[0.05, 0.05, 0.05]], requires_grad=True)
    mask = torch.ones(1, 3)
    gspo = GRPOLoss(objective="gspo", clip_eps=3e-4, clip_eps_high=4e-4, aggregation="seq_mean_token_mean")
    loss, metrics = gspo(LossInputs(lp, rollout, torch.tensor([1.0]), mask))
    loss.backward()
    assert (lp.grad == 0).all() and metrics["grpo/clipped_fraction"] == 1.0
    lp.grad = None
    GRPOLoss()(LossInputs(lp, rollout, torch.tensor([1.0]), mask))[0].backward()
    assert (lp.grad != 0).all()


def test_cispo_keeps_a_gradient_on_every_token_with_an_advantage_and_detaches_its_weight():
    # Ratios 3.0 (clipped to 1.28), 0.1 (no lower bound with clip_eps=1), 1.1; advantages of both signs and a zero.
    rollout = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[3.0, 0.1, 1.1, 3.0]])).requires_grad_()
    adv = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    mask = torch.ones(1, 4)
    loss, metrics = GRPOLoss(objective="cispo", clip_eps=1.0, clip_eps_high=0.28)(LossInputs(lp, rollout, adv, mask))
    loss.backward()
    g = lp.grad[0]
    # d loss / d logp_t = -w_t A_t / tokens with w = clip(r) detached: no d w / d logp term.
    w = [1.28, 0.1, 1.1, 1.28]
    assert g.tolist() == pytest.approx([-w[i] * adv[0, i].item() / 4 for i in range(4)], rel=1e-5)
    assert (g[:3] != 0).all() and g[3] == 0  # every token with a non-zero advantage keeps its gradient
    assert metrics["grpo/clipped_high"] == 0.5  # tokens 0 and 3: weight bounded, gradient kept
    # PPO's clip drops the gradient of the clipped token instead.
    lp.grad = None
    GRPOLoss(clip_eps=0.2, clip_eps_high=0.28)(LossInputs(lp, rollout, adv, mask))[0].backward()
    assert lp.grad[0, 0] == 0


def test_cispo_refuses_a_dual_clip():
    with pytest.raises(ValueError, match="dual_clip does not apply to loss.objective=cispo"):
        GRPOLoss(objective="cispo", dual_clip=3.0)


def _mismatched():
    """Trainer log-probs 0; sampler log-probs giving trainer/sampler ratios 1, 2.5, 0.4, 1.5 (sequence 0) and
    1, 1, 1.9, NaN (sequence 1: the last token has no sampler log-prob, so it is never masked)."""
    ratios = torch.tensor([[1.0, 2.5, 0.4, 1.5], [1.0, 1.0, 1.9, 1.0]])
    sampler = -torch.log(ratios)
    sampler[1, 3] = float("nan")
    lp = torch.zeros(2, 4, requires_grad=True)
    return lp, sampler, torch.ones(2, 4)


def test_the_token_mask_zeroes_exactly_the_tokens_outside_the_band():
    lp, sampler, mask = _mismatched()
    adv = torch.tensor([1.0, -1.0])
    loss_fn = GRPOLoss(clip_eps=0.9, clip_eps_high=9.0, token_mask=[0.5, 2.0])  # wide clip: only the mask acts
    loss, metrics = loss_fn(LossInputs(lp, sampler, adv, mask))
    loss.backward()
    outside = torch.tensor([[False, True, True, False], [False, False, False, False]])
    assert ((lp.grad == 0) == outside).all()
    assert metrics["mismatch/masked_fraction"] == pytest.approx(2 / 8)
    # The normaliser still counts the masked tokens: each kept token's gradient is the unmasked one.
    lp2 = lp.detach().clone().requires_grad_()
    GRPOLoss(clip_eps=0.9, clip_eps_high=9.0)(LossInputs(lp2, sampler, adv, mask))[0].backward()
    assert torch.equal(lp.grad[~outside], lp2.grad[~outside])


def test_the_sequence_mask_drops_a_sequence_by_its_geometric_mean_ratio():
    lp, sampler, mask = _mismatched()
    # Geometric means: sequence 0 (1 * 2.5 * 0.4 * 1.5)^(1/4) = 1.107, sequence 1 (1 * 1 * 1.9)^(1/3) = 1.239 (the
    # token without a sampler log-prob does not count).
    loss_fn = GRPOLoss(clip_eps=0.9, clip_eps_high=9.0, sequence_mask=[0.8, 1.2])
    loss, metrics = loss_fn(LossInputs(lp, sampler, torch.tensor([1.0, 1.0]), mask))
    loss.backward()
    assert (lp.grad[0] != 0).all() and (lp.grad[1] == 0).all()
    assert metrics["mismatch/masked_sequences"] == 0.5 and metrics["mismatch/masked_fraction"] == 0.5


@pytest.mark.parametrize("band", [[1.0, 2.0], [0.5, 1.0], [0.5], [2.0, 0.5]])
def test_a_band_that_excludes_ratio_one_is_refused(band):
    with pytest.raises(ValueError, match="loss.token_mask must be"):
        GRPOLoss(token_mask=band)


def test_the_mismatch_metric_is_zero_for_identical_logprobs_and_the_kl_otherwise():
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    mask = torch.ones(2, 3)
    _, same = GRPOLoss(token_mask=[0.5, 2.0])(LossInputs(lp, lp.clone(), torch.ones(2), mask))
    assert same["mismatch/kl"] == 0.0 and same["mismatch/kl_k1"] == 0.0 and same["mismatch/masked_fraction"] == 0.0
    sampler = lp + 0.1
    _, off = GRPOLoss()(LossInputs(lp, sampler, torch.ones(2), mask))
    # x = log pi - log mu = -0.1 at every token: k3 = exp(x) - 1 - x, k1 = -x.
    assert off["mismatch/kl"] == pytest.approx(math.expm1(-0.1) + 0.1, rel=1e-5)
    assert off["mismatch/kl_k1"] == pytest.approx(0.1, rel=1e-5)
    # No sampler log-probs (NaN): on-policy, nothing to compare.
    _, none = GRPOLoss()(LossInputs(lp, torch.full_like(lp, float("nan")), torch.ones(2), mask))
    assert none["mismatch/kl"] == 0.0


@pytest.mark.parametrize("option, settings", [
    ("gspo", {"objective": "gspo", "clip_eps": 3e-4, "clip_eps_high": 4e-4, "aggregation": "seq_mean_token_mean"}),
    ("cispo", {"objective": "cispo", "clip_eps": 1.0, "clip_eps_high": 0.28, "aggregation": "token_mean"}),
])
def test_loss_options_compose_into_the_one_loss_with_their_objective(option, settings):
    """`loss=gspo` / `loss=cispo` are YAML options of GRPOLoss setting `loss.objective` (and their clip range), built
    by the run's own builder."""
    from hydra import compose, initialize_config_dir

    from grpo.build import build_loss
    from grpo.conf import CONFIG_DIR
    from grpo.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["~experiment", f"loss={option}", "loss.token_mask=[0.5,2.0]"])
    loss = build_loss(cfg)
    assert type(loss) is GRPOLoss and loss.off_policy.token_mask == (0.5, 2.0)
    built = {"objective": loss.objective, "clip_eps": loss.clip.low, "clip_eps_high": loss.clip.high,
             "aggregation": loss.aggregation}
    assert built == settings

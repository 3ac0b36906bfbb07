"""GRPOLoss against hand-written per-token formulas (values and gradients)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import group_option
from grpo.algorithms.aggregation import Totals
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.loss_interface import LossInputs

REPO = Path(__file__).resolve().parents[1]

EPS = 0.2


def _inputs(B=4, T=6, seed=0, spread=0.6):
    """Random log-probs with ratios well outside [1-eps, 1+eps] on both sides, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    rollout = logp.detach() + (torch.rand(B, T, generator=g) - 0.5) * 2 * spread
    adv = torch.randn(B, generator=g)
    adv[0], adv[1] = 1.3, -0.9  # both signs for sure
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[2, :2] = 0
    return logp, rollout, adv, mask


def _ref_token(lp: float, q: float, a: float, lo: float, hi: float, dual=None):
    """(value of -objective, d(-objective)/d logp) for one token, written out case by case."""
    r = math.exp(lp - q)
    if a >= 0:
        # min(rA, clip(r)A) for A >= 0 is A*min(r, clip(r)): clipped (flat) only above 1+eps_high.
        if r > hi:
            return -hi * a, 0.0
        return -r * a, -r * a
    # A < 0: min(rA, clip(r)A) = A*max(r, clip(r)): flat only below 1-eps_low; above 1+eps it follows rA.
    if r < lo:
        val, grad = -lo * a, 0.0
    else:
        val, grad = -r * a, -r * a
    if dual is not None and -val < dual * a:  # objective below c*A: bounded at c*A, no gradient
        val, grad = -dual * a, 0.0
    return val, grad


def _reference(logp, rollout, adv, mask, lo, hi, dual=None):
    B, T = logp.shape
    vals = torch.zeros(B, T, dtype=torch.float64)
    grads = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if mask[b, t] == 0:
                continue
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            vals[b, t], grads[b, t] = _ref_token(float(logp.detach()[b, t]), float(rollout[b, t]), a, lo, hi, dual)
    return vals, grads


def test_token_mean_matches_reference_values_and_grads():
    logp, rollout, adv, mask = _inputs()
    loss_fn = GRPOLoss(clip_eps=EPS, clip_eps_high=0.28)
    loss, m = loss_fn(LossInputs(logp, rollout, adv, mask))
    loss.backward()
    vals, grads = _reference(logp, rollout, adv, mask, 1 - EPS, 1.28)
    n = mask.sum().item()
    assert loss.item() == pytest.approx(vals.sum().item() / n, rel=1e-5)
    torch.testing.assert_close(logp.grad.double(), grads / n, atol=1e-6, rtol=1e-5)
    # The random inputs really exercise both clip boundaries and both flat regions.
    assert m["grpo/clipped_low"] > 0 and m["grpo/clipped_high"] > 0
    assert m["grpo/clipped_fraction"] == pytest.approx(m["grpo/clipped_low"] + m["grpo/clipped_high"])
    assert all(isinstance(v, float) for v in m.values())


def test_negative_advantage_clipping_direction():
    """A < 0: ratio above 1+eps keeps its gradient (PPO), ratio below 1-eps is clipped (zero gradient).

    The reference trainer's max(rA, clip(r)A) gets exactly these two cases backwards.
    """
    q = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([-1.0])
    loss, m = GRPOLoss(clip_eps=EPS)(LossInputs(logp, q, adv, torch.ones(1, 2)))
    loss.backward()
    # token 0: r = 1.5 > 1.2, objective rA = -1.5 (more pessimistic than clip(r)A = -1.2) → grad of -rA/2 = 0.75.
    assert logp.grad[0, 0].item() == pytest.approx(0.75, rel=1e-6)
    # token 1: r = 0.5 < 0.8, objective clip(r)A = -0.8 → flat.
    assert logp.grad[0, 1].item() == 0.0
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2, rel=1e-6)
    assert m["grpo/clipped_low"] == 0.5 and m["grpo/clipped_high"] == 0.0


def test_positive_advantage_clipping_direction():
    q = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    loss, m = GRPOLoss(clip_eps=EPS)(LossInputs(logp, q, torch.tensor([2.0]), torch.ones(1, 2)))
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # r > 1.2 with A > 0: clipped
    assert logp.grad[0, 1].item() == pytest.approx(-0.5 * 2.0 / 2, rel=1e-6)
    assert m["grpo/clipped_high"] == 0.5


def test_dual_clip_matches_reference():
    logp, rollout, adv, mask = _inputs(seed=1, spread=2.5)  # ratios up to ~e^2.5 so c=3 bites
    loss, m = GRPOLoss(clip_eps=EPS, dual_clip=3.0)(LossInputs(logp, rollout, adv, mask))
    loss.backward()
    vals, grads = _reference(logp, rollout, adv, mask, 1 - EPS, 1 + EPS, dual=3.0)
    n = mask.sum().item()
    assert loss.item() == pytest.approx(vals.sum().item() / n, rel=1e-5)
    torch.testing.assert_close(logp.grad.double(), grads / n, atol=1e-6, rtol=1e-5)
    assert m["grpo/dual_clipped"] > 0


def test_per_token_advantages():
    logp, rollout, _, mask = _inputs(seed=2)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    loss, _ = GRPOLoss(clip_eps=EPS)(LossInputs(logp, rollout, adv, mask))
    loss.backward()
    vals, grads = _reference(logp, rollout, adv, mask, 1 - EPS, 1 + EPS)
    n = mask.sum().item()
    assert loss.item() == pytest.approx(vals.sum().item() / n, rel=1e-5)
    torch.testing.assert_close(logp.grad.double(), grads / n, atol=1e-6, rtol=1e-5)


def _per_token_values(logp, rollout, adv, mask):
    vals, _ = _reference(logp, rollout, adv, mask, 1 - EPS, 1 + EPS)
    return vals


def test_seq_mean_token_mean_by_hand():
    logp, rollout, adv, mask = _inputs(seed=3)
    loss, _ = GRPOLoss(clip_eps=EPS, aggregation="seq_mean_token_mean")(LossInputs(logp, rollout, adv, mask))
    vals = _per_token_values(logp, rollout, adv, mask)
    per_seq = [vals[b].sum().item() / mask[b].sum().item() for b in range(mask.shape[0])]
    assert loss.item() == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-5)


def test_seq_mean_token_sum_norm_by_hand():
    logp, rollout, adv, mask = _inputs(seed=4)
    vals = _per_token_values(logp, rollout, adv, mask)
    B = mask.shape[0]
    longest = mask.sum(1).max().item()
    loss, _ = GRPOLoss(clip_eps=EPS, aggregation="seq_mean_token_sum_norm")(LossInputs(logp, rollout, adv, mask))
    assert loss.item() == pytest.approx(sum(vals[b].sum().item() / longest for b in range(B)) / B, rel=1e-5)
    loss, _ = GRPOLoss(clip_eps=EPS, aggregation="seq_mean_token_sum_norm", max_tokens_norm=100)(
        LossInputs(logp, rollout, adv, mask))
    assert loss.item() == pytest.approx(sum(vals[b].sum().item() / 100 for b in range(B)) / B, rel=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_accumulation_equals_full_batch(aggregation):
    logp, rollout, adv, mask = _inputs(B=6, seed=6)
    fn = GRPOLoss(clip_eps=EPS, aggregation=aggregation)
    full, _ = fn(LossInputs(logp, rollout, adv, mask))
    (g_full,) = torch.autograd.grad(full, logp)
    total = 0.0
    longest = mask.sum(1).max().item()
    for sl in (slice(0, 2), slice(2, 6)):
        part, _ = fn(LossInputs(logp[sl], rollout[sl], adv[sl], mask[sl],
                                totals=Totals(tokens=mask.sum().item(), sequences=6, max_tokens=longest)))
        total = total + part
    (g_acc,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(g_acc, g_full)


def test_nan_rollout_rows_are_on_policy():
    logp, rollout, adv, mask = _inputs(seed=7)
    rollout[1] = float("nan")
    loss, m = GRPOLoss(clip_eps=EPS)(LossInputs(logp, rollout, adv, mask))
    loss.backward()
    assert torch.isfinite(loss)
    n = mask.sum().item()
    # Ratio 1 → unclipped for either sign: gradient -A / N on every loss token of that row.
    torch.testing.assert_close(logp.grad[1], -adv[1] * mask[1] / n)
    ref_rollout = rollout.clone()
    ref_rollout[1] = logp.detach()[1]
    _, grads = _reference(logp, ref_rollout, adv, mask, 1 - EPS, 1 + EPS)
    torch.testing.assert_close(logp.grad.double(), grads / n, atol=1e-6, rtol=1e-5)


def test_prompt_placeholders_and_padding_do_not_leak():
    """1.0 (prompt placeholder) and huge values at masked positions must not produce inf/NaN gradients."""
    logp = torch.full((1, 4), -2.0, requires_grad=True)
    inf = torch.tensor([[1.0, 1.0, -2.0, 80.0]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    loss, m = GRPOLoss()(LossInputs(logp, inf, torch.tensor([-1.0]), mask))
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2].item() == pytest.approx(1.0)
    assert m["grpo/mean_ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators(est):
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.ones(1, 3)
    fn = GRPOLoss(kl_coef=0.1, kl_estimator=est)
    # A = 0 and rollout = logp: only the KL term has a gradient.
    loss, m = fn(LossInputs(logp, logp.detach(), torch.zeros(1), mask, ref_logprobs=ref))
    loss.backward()
    x = [r - lp for r, lp in zip(ref[0].tolist(), logp[0].tolist())]
    value = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(x) - 1 - x}[est]
    dvalue_dlogp = {"k1": lambda x: 1.0, "k2": lambda x: -x, "k3": lambda x: 1 - math.exp(x)}[est]
    assert m["grpo/kl"] == pytest.approx(sum(value(v) for v in x) / 3, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * sum(value(v) for v in x) / 3, rel=1e-5)
    torch.testing.assert_close(logp.grad[0], torch.tensor([0.1 * dvalue_dlogp(v) / 3 for v in x]))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_entropy_bonus_is_subtracted_as_the_loss_is_aggregated(aggregation):
    """loss.entropy_coef: loss - coef * (the entropies aggregated as the loss), gradient -coef / N per loss token."""
    logp, rollout, adv, mask = _inputs(seed=5)
    entropy = torch.rand(logp.shape, requires_grad=True)
    base, _ = GRPOLoss(aggregation=aggregation)(LossInputs(logp, rollout, adv, mask))
    fn = GRPOLoss(entropy_coef=0.02, aggregation=aggregation)
    loss, _ = fn(LossInputs(logp, rollout, adv, mask, entropy=entropy))
    agg = (entropy * mask).sum() / mask.sum() if aggregation == "token_mean" else (
        ((entropy * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / (mask.sum(1) > 0).sum())
    assert float(loss) == pytest.approx(float(base) - 0.02 * float(agg), rel=1e-5)
    loss.backward()
    assert (entropy.grad[mask == 0] == 0).all() and (entropy.grad[mask > 0] < 0).all()
    with pytest.raises(ValueError, match="needs the per-token entropies"):
        fn(LossInputs(logp, rollout, adv, mask))
    # Off, the entropies are ignored.
    plain, _ = GRPOLoss(aggregation=aggregation)(LossInputs(logp, rollout, adv, mask, entropy=entropy))
    assert float(plain) == pytest.approx(float(base))


def test_an_entropy_target_steers_the_coefficient_and_a_constant_one_stays():
    """loss.entropy_target: the bonus is on from the start (even at coefficient 0), `adapt` moves the coefficient
    towards the target, the step's metrics carry the coefficient used, and state_dict round-trips it; without a
    target `adapt` changes nothing."""
    logp, rollout, adv, mask = _inputs(seed=6)
    entropy = torch.full(logp.shape, 0.5)
    steered = GRPOLoss(entropy_target=1.0, entropy_coef_delta=0.1)
    assert steered.needs.entropy and not steered.needs.zero_advantage_adds_nothing and steered.entropy.coef == 0.0
    _, m = steered(LossInputs(logp, rollout, adv, mask, entropy=entropy))
    assert m["grpo/entropy_coef"] == 0.0
    steered.adapt(0.5)
    steered.adapt(0.5)
    assert steered.entropy.coef == pytest.approx(0.2)
    steered.adapt(1.5)
    assert steered.entropy.coef == pytest.approx(0.1)
    fresh = GRPOLoss(entropy_target=1.0)
    fresh.load_state_dict(steered.state_dict())
    assert fresh.entropy.coef == pytest.approx(0.1)
    constant = GRPOLoss(entropy_coef=0.05)
    constant.adapt(0.0)
    assert constant.entropy.coef == 0.05
    assert "grpo/entropy_coef" not in GRPOLoss()(LossInputs(logp, rollout, adv, mask))[1]
    with pytest.raises(ValueError, match="entropy_target needs"):
        GRPOLoss(entropy_coef=0.6, entropy_target=0.3, entropy_coef_max=0.5)


def test_kl_against_rollout_when_no_ref_and_ref_nan_falls_back():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.2, -1.0]])
    fn = GRPOLoss(kl_coef=1.0, kl_estimator="k1", kl_reference="rollout")
    _, m = fn(LossInputs(logp, rollout, torch.zeros(1), torch.ones(1, 2)))
    assert m["grpo/kl"] == pytest.approx(((-1.0 + 1.2) + (-2.0 + 1.0)) / 2, rel=1e-5)
    _, m2 = fn(LossInputs(logp, rollout, torch.zeros(1), torch.ones(1, 2), ref_logprobs=torch.full((1, 2), float("nan"))))
    assert m2["grpo/kl"] == pytest.approx(m["grpo/kl"])
    assert m["grpo/logprob_diff"] == pytest.approx((0.2 + 1.0) / 2, rel=1e-5)


def test_truncated_importance_sampling():
    logp, rollout, adv, mask = _inputs(seed=8, spread=2.0)
    cap = 2.0
    loss, m = GRPOLoss(clip_eps=EPS, tis_cap=cap)(LossInputs(logp, rollout, adv, mask))
    loss.backward()
    w = torch.exp(logp.detach() - rollout).clamp(max=cap)
    n = mask.sum()
    # Proximal ratio is 1 → never clipped; gradient = -min(r, cap) * A / N.
    torch.testing.assert_close(logp.grad, -w * adv[:, None] * mask / n)
    assert loss.item() == pytest.approx((-(w * adv[:, None] * mask).sum() / n).item(), rel=1e-5)
    assert m["grpo/tis_capped"] > 0


def test_empty_mask_gives_zero_loss_with_graph():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = GRPOLoss()(LossInputs(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3)))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="aggregation"):
        GRPOLoss(aggregation="sum")
    with pytest.raises(ValueError, match="dual_clip"):
        GRPOLoss(dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPOLoss(kl_estimator="k4")
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        GRPOLoss(entropy_coef=-0.01)


def test_constructor_matches_config_keys():
    from omegaconf import OmegaConf

    from grpo.schema import LossConfig

    for name in ("grpo", "dapo", "dr_grpo", "gspo", "cispo"):
        cfg = OmegaConf.to_container(group_option("loss", name))
        cfg.pop("_target_")
        GRPOLoss(**cfg)
    fields = set(LossConfig.__dataclass_fields__) - {"_target_"}
    GRPOLoss(**{k: getattr(LossConfig(), k) for k in fields})


def test_the_loss_reads_as_its_settings_in_the_start_up_log():
    from grpo.schema import Aggregation
    from grpo.trainer.loss import GRPOLoss

    text = repr(GRPOLoss(clip_eps=0.3, kl_coef=0.1, aggregation=Aggregation("seq_mean_token_mean")))
    assert text.startswith("GRPOLoss(objective='ppo_clip', clip_eps=0.3, clip_eps_high=0.3,") and "object at" not in text
    assert "kl_coef=0.1" in text and "aggregation='seq_mean_token_mean'" in text

"""grpo.algorithms: the registries and the functions registered in them, on hand-made tensors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.algorithms.advantages import ADVANTAGE_ESTIMATORS, GroupRewards, step_advantages
from grpo.algorithms.aggregation import AGGREGATIONS, Totals
from grpo.algorithms.kl import KL_ESTIMATORS
from grpo.algorithms.policy import POLICY_OBJECTIVES, ClipRange
from grpo.algorithms.registry import Registry
from grpo.algorithms.schedules import LR_SCHEDULES
from grpo.conf import CONFIG_DIR
from grpo.pipeline.batching import prepare_batch

F64 = torch.float64


def test_an_unknown_name_is_refused_naming_the_key_and_the_choices():
    with pytest.raises(ValueError) as e:
        ADVANTAGE_ESTIMATORS.get("rloo_typo", "train.advantage_norm")
    assert "train.advantage_norm" in str(e.value) and "'group', 'batch', 'none'" in str(e.value)
    assert "rloo_typo" in str(e.value)


def test_a_taken_name_cannot_be_given_to_another_function():
    registry: Registry = Registry("thing")
    first = registry.register("a")(lambda x: x)
    assert registry.register("a")(first) is first  # the same function again is harmless (a module re-imported)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.register("a")(lambda x: x + 1)


def test_the_config_enum_is_the_registry_names():
    from grpo import schema

    assert [m.value for m in schema.AdvantageNorm] == list(ADVANTAGE_ESTIMATORS.names()) == [
        "group", "batch", "none", "dr_grpo", "rloo"]
    assert [m.value for m in schema.Aggregation] == list(AGGREGATIONS.names())
    assert [m.value for m in schema.KLEstimator] == list(KL_ESTIMATORS.names()) == ["k1", "k2", "k3"]
    assert [m.value for m in schema.LRSchedule] == list(LR_SCHEDULES.names())
    assert schema.AdvantageNorm.__module__ == "grpo.schema.train"  # where pickle finds it


def test_advantage_estimators_on_one_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    batch = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0], dtype=F64)
    group = ADVANTAGE_ESTIMATORS.get("group", "k")(scores, batch)
    assert group.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # population std 0.5
    centered = ADVANTAGE_ESTIMATORS.get("none", "k")(scores, batch)
    assert centered.tolist() == [0.5, -0.5, -0.5, 0.5]
    by_batch = ADVANTAGE_ESTIMATORS.get("batch", "k")(scores, batch)
    assert by_batch.tolist() == pytest.approx((centered / (batch.std(unbiased=False) + 1e-6)).tolist())
    # A group whose rewards all agree carries no signal: advantage 0, not 0/0.
    same = torch.full((4,), 0.7, dtype=F64)
    assert ADVANTAGE_ESTIMATORS.get("group", "k")(same, batch).tolist() == [0.0] * 4


def test_the_advantage_stage_keeps_sent_advantages_estimates_the_rest_and_zeroes_overrides():
    calls = []

    def centered(scores: torch.Tensor, batch_scores: torch.Tensor) -> torch.Tensor:
        calls.append((scores.tolist(), batch_scores.tolist()))
        return scores - scores.mean()

    groups = [GroupRewards([1.0, 3.0], [None, None], [False, True]),  # estimated; the second zeroed
              GroupRewards([0.0, 2.0], [0.5, None], [False, False]),  # the sent one kept, the other estimated
              GroupRewards([5.0, 5.0], [[0.1, 0.2], 0.3], [True, False])]  # all sent: no estimate; per token zeroed
    assert step_advantages(groups, centered) == [[-1.0, 0.0], [0.5, 1.0], [[0.0, 0.0], 0.3]]
    # Only the groups that miss an advantage are estimated, each with every score of the step as its batch.
    step = [1.0, 3.0, 0.0, 2.0, 5.0, 5.0]
    assert calls == [([1.0, 3.0], step), ([0.0, 2.0], step)]


def _groups():
    return [{"tokens": [[1, 2, 3]] * 3, "masks": [[-100, 2, 3]] * 3, "scores": [0.0, 1.0, 2.0]}]


def test_the_batcher_takes_a_users_own_estimator_as_a_function():
    def best_gets_one(scores: torch.Tensor, batch_scores: torch.Tensor) -> torch.Tensor:
        return (scores == scores.max()).to(scores.dtype)

    batch = prepare_batch(_groups(), advantage_norm=best_gets_one, max_seq_len=8, micro_batch_size=4, pad_token_id=0)
    assert batch.micro_batches[0].advantages.tolist() == [0.0, 0.0, 1.0]


def test_the_batcher_takes_an_estimator_registered_by_name():
    name = "test_rank_of_score"
    if name not in ADVANTAGE_ESTIMATORS:
        ADVANTAGE_ESTIMATORS.register(name)(lambda scores, batch_scores: scores.argsort().argsort().to(scores.dtype))
    batch = prepare_batch(_groups(), advantage_norm=name, max_seq_len=8, micro_batch_size=4, pad_token_id=0)
    assert batch.micro_batches[0].advantages.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name,expected", [("k1", lambda x: -x), ("k2", lambda x: x * x / 2),
                                           ("k3", lambda x: math.exp(x) - 1 - x)])
def test_kl_estimators(name, expected):
    x = torch.tensor([-0.5, 0.0, 0.3], dtype=F64)
    assert KL_ESTIMATORS.get(name, "k")(x).tolist() == pytest.approx([expected(v) for v in x.tolist()])


def test_aggregations_with_and_without_step_totals():
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    agg = {n: AGGREGATIONS.get(n, "k") for n in AGGREGATIONS.names()}
    assert float(agg["token_mean"](per_token, mask, Totals())) == pytest.approx(6 / 3)
    assert float(agg["token_mean"](per_token, mask, Totals(tokens=6))) == pytest.approx(1.0)
    assert float(agg["seq_mean_token_mean"](per_token, mask, Totals())) == pytest.approx((1.5 + 3) / 2)
    assert float(agg["seq_mean_token_mean"](per_token, mask, Totals(sequences=4))) == pytest.approx((1.5 + 3) / 4)
    # Dr. GRPO: every sequence's sum over the same length (the longest, 2; or a constant).
    assert float(agg["seq_mean_token_sum_norm"](per_token, mask, Totals())) == pytest.approx((3 / 2 + 3 / 2) / 2)
    assert float(agg["seq_mean_token_sum_norm"](per_token, mask, Totals(max_tokens=10))) == pytest.approx(0.3)


def test_ppo_clip_drops_the_gradient_exactly_where_the_clip_binds():
    # Ratios 1.5 (A > 0: clipped at 1.2), 0.5 (A < 0: clipped at 0.8), 1.1 (inside), 0.5 with A > 0 (min keeps r A).
    log_ratio = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.5]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=F64)
    out = POLICY_OBJECTIVES.get("ppo_clip", "k")(log_ratio, adv, torch.ones_like(adv), ClipRange(0.2, 0.2))
    assert out.objective[0].tolist() == pytest.approx([1.2, -0.8, 1.1, 0.5])
    out.objective.sum().backward()
    assert [g != 0 for g in log_ratio.grad[0].tolist()] == [False, False, True, True]
    assert not out.dual_clipped.any()


def test_ppo_dual_clip_floors_a_negative_advantage():
    log_ratio = torch.log(torch.tensor([[5.0, 5.0]], dtype=F64))
    adv = torch.tensor([[-1.0, 1.0]], dtype=F64)
    out = POLICY_OBJECTIVES.get("ppo_clip", "k")(log_ratio, adv, torch.ones_like(adv), ClipRange(0.2, 0.2, dual=3.0))
    assert out.objective[0].tolist() == pytest.approx([-3.0, 1.2])
    assert out.dual_clipped.tolist() == [[True, False]]


def test_lr_schedules_run_from_one_to_their_end():
    ends = {n: (LR_SCHEDULES.get(n, "k")(0.0), LR_SCHEDULES.get(n, "k")(1.0)) for n in LR_SCHEDULES.names()}
    assert ends["constant"] == (1.0, 1.0) and ends["linear"] == (1.0, 0.0)
    assert ends["cosine"][0] == 1.0 and ends["cosine"][1] == pytest.approx(0.0)
    assert LR_SCHEDULES.get("cosine", "k")(0.5) == pytest.approx(0.5)


def test_an_estimator_registered_before_the_schema_is_a_config_choice(tmp_path):
    """A user's own estimator by name: registered before `grpo.schema` is imported (a script that then runs
    the Hydra app), `train.advantage_norm=<name>` composes and the batcher runs it."""
    conf = CONFIG_DIR
    script = f"""
import torch
from grpo.algorithms.advantages import ADVANTAGE_ESTIMATORS, GroupRewards, step_advantages

@ADVANTAGE_ESTIMATORS.register("best_gets_one")
def best_gets_one(scores, batch_scores):
    return (scores == scores.max()).to(scores.dtype)

from hydra import compose, initialize_config_dir
from grpo.config import register_configs
from grpo.pipeline.batching import prepare_batch

register_configs()
with initialize_config_dir(config_dir={str(conf)!r}, version_base="1.3"):
    cfg = compose("train", overrides=["~experiment", "train.advantage_norm=best_gets_one"])
groups = [{{"tokens": [[1, 2, 3]] * 3, "masks": [[-100, 2, 3]] * 3, "scores": [0.0, 1.0, 2.0]}}]
batch = prepare_batch(groups, advantage_norm=cfg.train.advantage_norm, max_seq_len=8, micro_batch_size=4,
                      pad_token_id=0)
print(batch.micro_batches[0].advantages.tolist())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[0.0, 0.0, 1.0]"


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    rloo = ADVANTAGE_ESTIMATORS.get("rloo", "k")
    assert rloo(scores, scores).tolist() == pytest.approx([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    # The baseline excludes the sample itself: raising one score moves its own advantage by exactly that much
    # (a baseline that included it would absorb a 1/G share) and every other advantage by -delta / (G - 1).
    raised = scores.clone()
    raised[0] += 3.0
    moved = rloo(raised, raised) - rloo(scores, scores)
    assert moved.tolist() == pytest.approx([3.0, -1.0, -1.0, -1.0])
    # G / (G - 1) times the group-centred advantage; a group of one has no other sample: 0.
    assert rloo(scores, scores).tolist() == pytest.approx((4 / 3 * (scores - scores.mean())).tolist())
    assert rloo(torch.tensor([5.0], dtype=F64), scores).tolist() == [0.0]


def test_dr_grpo_is_the_mean_only_advantage():
    scores = torch.tensor([2.0, 0.0, 1.0], dtype=F64)
    assert ADVANTAGE_ESTIMATORS.get("dr_grpo", "k")(scores, scores).tolist() == [1.0, -1.0, 0.0]
    assert ADVANTAGE_ESTIMATORS.get("dr_grpo", "k") is ADVANTAGE_ESTIMATORS.get("none", "k")


def test_the_documented_own_estimator_example_runs(tmp_path):
    """docs/algorithms.md, "An estimator of your own": the example script registers its estimator, then runs the
    trainer's entry point, which takes `train.advantage_norm=best_gets_one` (the config composes with it; --cfg job
    trains nothing), and the batcher computes that estimator's advantages."""
    repo = Path(__file__).resolve().parents[1]
    example = repo / "examples" / "own_estimator" / "train_with_my_estimator.py"
    page = (repo / "docs" / "algorithms.md").read_text()
    assert str(example.relative_to(repo)) in page
    code = example.read_text().split('"""', 2)[2].strip()  # the file after its docstring is the page's code block
    assert f"```python\n{code}\n```" in page
    out = subprocess.run([sys.executable, str(example), "~experiment", "train.advantage_norm=best_gets_one",
                          "--cfg", "job"], capture_output=True, text=True, cwd=repo, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "advantage_norm: best_gets_one" in out.stdout
    script = f"""
import runpy
runpy.run_path({str(example)!r})
from grpo.pipeline.batching import prepare_batch
groups = [{{"tokens": [[1, 2, 3]] * 3, "masks": [[-100, 2, 3]] * 3, "scores": [0.0, 2.0, 2.0]}}]
batch = prepare_batch(groups, advantage_norm="best_gets_one", max_seq_len=8, micro_batch_size=4, pad_token_id=0)
print(batch.micro_batches[0].advantages.tolist())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[0.0, 1.0, 1.0]"


def test_the_entropy_coefficient_rises_below_the_target_falls_above_and_stays_in_its_range():
    from grpo.algorithms.entropy_control import adapt_entropy_coef

    assert adapt_entropy_coef(0.1, entropy=0.2, target=0.3, delta=0.05, max_coef=1.0) == pytest.approx(0.15)
    assert adapt_entropy_coef(0.1, entropy=0.4, target=0.3, delta=0.05, max_coef=1.0) == pytest.approx(0.05)
    assert adapt_entropy_coef(0.02, entropy=0.4, target=0.3, delta=0.05, max_coef=1.0) == 0.0  # never negative
    assert adapt_entropy_coef(0.98, entropy=0.1, target=0.3, delta=0.05, max_coef=1.0) == 1.0  # the ceiling
    assert adapt_entropy_coef(0.1, entropy=0.3, target=0.3, delta=0.05, max_coef=1.0) == pytest.approx(0.05)  # at it: down

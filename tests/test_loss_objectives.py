"""`loss.objective`: GSPO and CISPO as YAML options of the one loss, giving the losses they gave as classes of their
own, and a new objective that is a registered function plus a YAML, nothing else."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo.algorithms.aggregation import Totals
from grpo.build import build_loss
from grpo.conf import CONFIG_DIR
from grpo.config import register_configs
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.loss_interface import LossInputs

F64 = torch.float64
register_configs()


def _fixed():
    """Fixed [3, 5] float64 inputs (no RNG): trainer and sampler log-probs up to 0.25 nats apart, one token without a
    sampler log-prob, a padded tail, advantages of both signs and a zero, recomputed pi_old, reference log-probs and
    entropies."""
    i = torch.arange(15, dtype=F64).reshape(3, 5)
    logprobs = -0.3 - (i * 0.37) % 2.1
    inference = logprobs + 0.25 * torch.sin(1.7 * i)
    inference[1, 3] = float("nan")
    old = logprobs + 0.05 * torch.cos(2.3 * i)
    ref = logprobs - 0.1 * torch.cos(0.9 * i)
    mask = torch.ones(3, 5, dtype=F64)
    mask[2, 3:] = 0
    advantages = torch.tensor([1.2, -0.7, 0.0], dtype=F64)
    entropy = 0.5 + 0.3 * torch.cos(1.1 * i)
    return logprobs, inference, old, ref, mask, advantages, entropy


VARIANTS = {
    "yaml": [],
    "recompute_tis": ["loss.old_logprobs=recompute", "loss.tis_cap=1.1"],
    "kl_entropy": ["loss.kl_coef=0.1", "loss.entropy_coef=0.02"],
    "narrow": ["loss.clip_eps=0.1", "loss.clip_eps_high=0.1"],
    "masks": ["loss.token_mask=[0.8,1.25]", "loss.sequence_mask=[0.95,1.05]", "loss.old_logprobs=recompute"],
}
# (loss, sum of d loss / d logprobs, the same weighted by 1..15, grpo/clipped_fraction) on `_fixed()`, computed by the
# loss as it was before the objective became a key (GSPOLoss / CISPOLoss, subclasses of GRPOLoss chosen by a class
# attribute; commit 17b4192) with the YAML options' settings plus each variant's, totals (20 tokens, 4 sequences).
BEFORE = {
    ("gspo", "yaml"): (-0.11939057543709863, -0.11939057543709869, 0.5222166017830739, 0.0),
    ("gspo", "recompute_tis"): (-0.11410491489924018, -0.28829308573353307, -0.8648792572005992, 0.38461538461538464),
    ("gspo", "kl_entropy"): (-0.12745336862341666, -0.12055536180179338, 0.5052857021688024, 0.0),
    ("gspo", "narrow"): (-0.11939057543709863, -0.11939057543709869, 0.5222166017830739, 0.0),
    ("gspo", "masks"): (-0.004940119821098848, -0.17988761982109885, -0.5396628594632966, 0.38461538461538464),
    ("cispo", "yaml"): (0.0013106635155264751, -0.12153452377235396, 0.509419879378709, 0.0),
    ("cispo", "recompute_tis"): (0.00048631008252517235, -0.11362312881137435, 0.5274805660563067, 0.0),
    ("cispo", "kl_entropy"): (-0.005439903053660176, -0.12200594982709737, 0.5005567375970332, 0.0),
    ("cispo", "narrow"): (0.003950167254270487, -0.12276307983412967, 0.5045766431827534, 0.6153846153846154),
    ("cispo", "masks"): (-0.0012735539088350625, -0.006217558253762467, 0.8421308910921345, 0.0),
}


def _composed_loss(overrides: list[str]) -> GRPOLoss:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return build_loss(compose("train", overrides=["~experiment", *overrides]))


@pytest.mark.parametrize("option, variant", list(BEFORE))
def test_gspo_and_cispo_through_the_key_give_the_losses_they_gave_as_classes(option, variant):
    loss_fn = _composed_loss([f"loss={option}", *VARIANTS[variant]])
    assert type(loss_fn) is GRPOLoss and loss_fn.objective == option
    logprobs, inference, old, ref, mask, adv, entropy = _fixed()
    logprobs.requires_grad_(True)
    needs = loss_fn.needs
    inputs = LossInputs(logprobs, inference, adv, mask, ref_logprobs=ref,
                        old_logprobs=old if needs.recomputed_old_logprobs else None,
                        entropy=entropy if needs.entropy else None, totals=Totals(tokens=20.0, sequences=4.0))
    loss, metrics = loss_fn(inputs)
    loss.backward()
    weights = torch.arange(1, 16, dtype=F64).reshape(3, 5)
    got = (loss.item(), logprobs.grad.sum().item(), (logprobs.grad * weights).sum().item(),
           metrics["grpo/clipped_fraction"])
    assert got == pytest.approx(BEFORE[option, variant], rel=1e-12, abs=1e-15)


def test_the_objective_key_on_the_grpo_option_is_the_same_loss_as_the_option():
    """`loss.objective=cispo` with CISPO's clip range on `loss=grpo` builds what `loss=cispo` builds: the option is
    only the YAML that sets the key."""
    by_option = _composed_loss(["loss=cispo"])
    by_key = _composed_loss(["loss.objective=cispo", "loss.clip_eps=1.0", "loss.clip_eps_high=0.28"])
    assert repr(by_key) == repr(by_option)


def test_an_objective_nobody_registered_is_refused_when_composed():
    with pytest.raises(Exception, match="ppo_clip"):  # Hydra's validation error lists the registered names
        _composed_loss(["loss.objective=ppo_clipp"])


@pytest.mark.slow
def test_a_new_objective_is_a_registered_function_and_a_yaml(tmp_path, tiny_qwen2_dir):
    """A user's objective: a function registered with @policy_objective before the schema is imported, and
    conf/loss/<name>.yaml in a config dir of one's own setting `objective`. Nothing else changes: the run's builder
    builds it, the loss computes it (the unclipped r * A: gradient -r A / n at every token, where PPO's clip would have
    dropped some), and the trainer takes an update with it (fused and unfused)."""
    conf = tmp_path / "conf" / "loss"
    conf.mkdir(parents=True)
    (conf / "plain_pg.yaml").write_text("defaults:\n  - grpo\n  - _self_\n\nobjective: plain_pg\n")
    script = textwrap.dedent(f"""
        import torch
        from grpo.algorithms.policy import Surrogate, policy_objective, ratio

        @policy_objective("plain_pg")
        def plain_pg(log_ratio, advantages, mask, clip):
            r = ratio(log_ratio)
            never = torch.zeros_like(advantages, dtype=torch.bool)
            return Surrogate(r * advantages, r, never, never, never)

        from types import SimpleNamespace
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf
        from transformers import AutoModelForCausalLM
        from grpo.build import build_loss
        from grpo.conf import CONFIG_DIR
        from grpo.config import register_configs
        from grpo.pipeline.batching import prepare_batch
        from grpo.schema.train import TrainConfig
        from grpo.trainer.loop import GRPOTrainer
        from grpo.trainer.loss_interface import LossInputs
        from grpo.trainer.metrics import NullMetrics

        register_configs()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=["~experiment", "loss=plain_pg",
                                              "hydra.searchpath=[file://{tmp_path / 'conf'}]"])
        loss_fn = build_loss(cfg)
        lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
        adv = torch.tensor([[1.0, -1.0, 1.0]])
        loss, m = loss_fn(LossInputs(lp, torch.zeros(1, 3), adv, torch.ones(1, 3)))
        loss.backward()
        print("LOSS", type(loss_fn).__name__, loss_fn.objective, round(loss.item(), 6),
              [round(g, 6) for g in lp.grad[0].tolist()], m["grpo/clipped_fraction"])

        model = AutoModelForCausalLM.from_pretrained({str(tiny_qwen2_dir)!r}, dtype=torch.float32)
        groups = [{{"tokens": [[1, 2, 3, 4, 5], [1, 2, 6, 7]], "masks": [[-100, -100, 3, 4, 5], [-100, -100, 6, 7]],
                    "scores": [1.0, 0.0], "inference_logprobs": [[1.0, 1.0, -2.0, -3.0, -1.0], [1.0, 1.0, -4.0, -0.5]]}}]
        for fused in (True, False):
            train = OmegaConf.structured(TrainConfig(steps=1, micro_batch_size=2, fused_loss=fused))
            sync = SimpleNamespace(version=0, prepare_step=lambda step: None, serves_weights_in_place=False)
            trainer = GRPOTrainer(train_cfg=train, model=model, tokenizer=None,
                                  optimizer=torch.optim.SGD(model.parameters(), 0.0), scheduler=None, loss_fn=loss_fn,
                                  pipeline=None, sync=sync, checkpoints=None, metrics=NullMetrics(),
                                  device=torch.device("cpu"))
            batch = prepare_batch(groups, max_seq_len=16, micro_batch_size=2, pad_token_id=0)
            total, metrics = trainer.forward_backward(batch)
            grad = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
            print("TRAIN", fused, total != 0.0, grad > 0, metrics["grpo/clipped_fraction"])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # r = 1.5, 0.5, 1.1 and A = 1, -1, 1: loss -(1.5 - 0.5 + 1.1) / 3; d/dlogp -r A / 3 at every token (PPO's clip
    # would leave tokens 0 and 1 without a gradient).
    assert "LOSS GRPOLoss plain_pg -0.7 [-0.5, 0.166667, -0.366667] 0.0" in lines
    assert lines[-2:] == ["TRAIN True True True 0.0", "TRAIN False True True 0.0"]

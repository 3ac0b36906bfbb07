"""Optimizers from the real conf/optimizer/*.yaml, schedules, layer selection and LoRA placement."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import group_option
from grpo.conf import CONFIG_DIR
from grpo.trainer.layers import apply_lora, freeze_to_layers, resolve_layer_indices
from grpo.trainer.optim import (
    OptimizerUnavailableError,
    build_optimizer,
    build_scheduler,
    check_optimizer_available,
    lr_lambda,
)

REPO = Path(__file__).resolve().parents[1]


def optimizer_cfg(name: str, model_lr: float = 1e-3):
    """The optimizer option as a run composes it: its `lr: ${model.lr}` resolved against a model preset's lr."""
    cfg = group_option("optimizer", name)
    resolved = OmegaConf.merge({"model": {"lr": model_lr}, "optimizer": cfg})
    OmegaConf.resolve(resolved)
    return resolved.optimizer


@pytest.fixture
def model(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)


def _step(model, opt):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "adafactor"])
def test_optimizer_from_config_steps(model, name):
    cfg = optimizer_cfg(name)
    cfg.weight_decay = 0.01
    opt = build_optimizer(model, cfg)
    assert type(opt).__module__.split(".")[0] == cfg._target_.split(".")[0]  # no substitution
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, opt)
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(changed) == len(before), set(before) - set(changed)


def test_adamw_fused_is_passed_only_when_set(model):
    """optimizer.fused=true reaches torch's AdamW (its fused kernel, which also runs on CPU); null is not passed, so
    optimizers without the keyword (bitsandbytes) still build from the same schema."""
    cfg = optimizer_cfg("adamw")
    assert cfg.fused is None
    assert build_optimizer(model, cfg).defaults["fused"] is None  # torch's default
    cfg.fused = True
    opt = build_optimizer(model, cfg)
    assert opt.defaults["fused"] is True
    before = model.lm_head.weight.detach().clone()
    _step(model, opt)
    assert not torch.equal(before, model.lm_head.weight.detach())


def test_param_groups_exclude_norms_and_biases(model):
    cfg = optimizer_cfg("adamw")
    cfg.weight_decay = 0.1
    for n, p in model.named_parameters():
        if "layers.0." in n:
            p.requires_grad_(False)
    opt = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decayed and plain
    assert all("norm" not in n and not n.endswith(".bias") for n in decayed)
    assert any(n.endswith("q_proj.bias") for n in plain) and any("layernorm" in n for n in plain)
    assert not any("layers.0." in n for n in decayed | plain)  # frozen params stay out
    assert all(p.ndim >= 2 for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"])


def test_missing_package_error_names_it(monkeypatch, model):
    # A None entry in sys.modules makes `import bitsandbytes` raise ImportError, as if it were not installed.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", None)
    cfg = optimizer_cfg("adamw_8bit")
    with pytest.raises(OptimizerUnavailableError, match="pip install bitsandbytes"):
        check_optimizer_available(cfg)
    with pytest.raises(OptimizerUnavailableError, match="bitsandbytes"):
        build_optimizer(model, cfg)
    cfg._target_ = "no_such_pkg.optim.Thing"
    with pytest.raises(OptimizerUnavailableError, match="no_such_pkg"):
        check_optimizer_available(cfg)


def test_schedules():
    assert [round(lr_lambda(s, "constant", 3, 10), 4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_lambda(3, "linear", 3, 13) == 1.0 and lr_lambda(8, "linear", 3, 13) == pytest.approx(0.5)
    assert lr_lambda(13, "linear", 3, 13) == 0.0 and lr_lambda(20, "cosine", 3, 13) == pytest.approx(0.0)
    assert lr_lambda(8, "cosine", 3, 13) == pytest.approx(0.5)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, "cosine", 0, 4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466])
    with pytest.raises(ValueError, match="schedule"):
        build_scheduler(opt, "step", 0, 4)


def test_a_warmup_as_long_as_the_run_is_said_without_a_warning(caplog):
    """`python train.py train.steps=3` keeps the default job's train.warmup_steps=10: the whole run trained at a
    fraction of optimizer.lr (27 % at the last step), silently; then it was a WARNING on every short run, the
    README's own `train.steps=10` examples included (issue 44.19): it is said at INFO."""
    import logging

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level(logging.INFO, logger="grpo.trainer.optim"):
        build_scheduler(opt, "constant", 10, 3)
    assert "train.warmup_steps=10 is not below train.steps=3" in caplog.text and "peaks at 27% of optimizer.lr" in caplog.text
    assert all(r.levelno < logging.WARNING for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="grpo.trainer.optim"):
        build_scheduler(opt, "constant", 10, 60)  # the default job: warmup, then the full rate
    assert "warmup" not in caplog.text


@pytest.mark.parametrize(
    "spec, n, expected",
    [
        ("all", 4, [0, 1, 2, 3]),
        ("top25", 4, [3]),
        ("top25", 36, list(range(27, 36))),
        ("top50", 28, list(range(14, 28))),
        ("top1", 4, [3]),  # at least one block
        ("first50", 4, [0, 1]),
        ("last12", 36, list(range(24, 36))),
        ("last4", 4, [0, 1, 2, 3]),
        ("20-31", 32, list(range(20, 32))),
        ("0-3,28-31", 32, [0, 1, 2, 3, 28, 29, 30, 31]),
        ("5", 8, [5]),
        (2, 4, [2]),
    ],
)
def test_resolve_layer_indices(spec, n, expected):
    assert resolve_layer_indices(spec, n) == expected


@pytest.mark.parametrize("spec", ["last12", "20-31", "0-4", "4", "top0", "top150", "bottom3", "3-1", "1-x", ""])
def test_resolve_layer_indices_errors_name_layer_count(spec):
    with pytest.raises(ValueError) as e:
        resolve_layer_indices(spec, 4)
    assert "4 layers" in str(e.value) and repr(spec) in str(e.value)


def test_every_layers_preset_resolves_for_its_models():
    for path in (CONFIG_DIR / "layers").glob("*.yaml"):
        spec = group_option("layers", path.stem).indices
        assert resolve_layer_indices(spec, 36)


def test_freeze_to_layers_exact_params(model):
    total = sum(p.numel() for p in model.parameters())
    n = freeze_to_layers(model, [2, 3])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in trainable)
    expected = {name for name, _ in model.named_parameters() if name.startswith(("model.layers.2.", "model.layers.3."))}
    assert trainable == expected
    assert n == sum(p.numel() for p in model.parameters() if p.requires_grad) < total
    assert freeze_to_layers(model, [0, 1, 2, 3]) == total
    with pytest.raises(ValueError, match="4 layers"):
        freeze_to_layers(model, [4])


def test_frozen_layers_do_not_move(model):
    freeze_to_layers(model, resolve_layer_indices("top25", 4))
    opt = build_optimizer(model, optimizer_cfg("adamw"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, opt)
    for name, p in model.named_parameters():
        moved = not torch.equal(before[name], p.detach())
        assert moved == name.startswith("model.layers.3."), name


def test_apply_lora_layers_to_transform(model):
    lora_cfg = group_option("lora", "attention")
    peft_model = apply_lora(model, lora_cfg, [1, 3], 4)
    assert peft_model.peft_config["default"].layers_to_transform == [1, 3]
    assert peft_model.peft_config["default"].r == lora_cfg.r
    assert peft_model.peft_config["default"].lora_alpha == lora_cfg.alpha
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    layers = {int(n.split("layers.")[1].split(".")[0]) for n in trainable}
    assert layers == {1, 3}
    modules = {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable}
    assert modules == set(lora_cfg.target_modules)


def test_apply_lora_all_layers(model):
    peft_model = apply_lora(model, {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}, [0, 1, 2, 3])
    assert peft_model.peft_config["default"].layers_to_transform is None
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert len(trainable) == 8  # A and B on q_proj in each of 4 blocks
    with pytest.raises(ValueError, match="4 layers"):
        apply_lora(model, {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}, [7])

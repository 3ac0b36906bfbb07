"""train.prefix_sharing: each distinct prompt of a micro-batch forwarded once gives the unshared path's per-token
log-probs, loss and gradients (fused and chunked, pi_old recompute, mini-batch splits that cut groups), and is
refused where it cannot apply."""

from __future__ import annotations

import random

import pytest
import torch
from omegaconf import OmegaConf

from grpo.conf import CONFIG_DIR
from grpo.config import ConfigError
from grpo.pipeline.batching import prepare_batch
from grpo.pipeline.group import Group
from grpo.trainer import prefix
from grpo.trainer.logprobs import token_logprobs
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.minibatch import split_mini_batches
from grpo.trainer.train_batch import IGNORE_INDEX
from grpo.trainer.train_checks import check_prefix_sharing
from test_packing import update_trainer


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _groups(seed: int = 0, n_groups: int = 3, group_size: int = 4) -> list[Group]:
    """Groups with prompts of different lengths (4, 5, 6 tokens) and completions of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(3, 250, (4 + k,), generator=g).tolist()
        comps = [torch.randint(3, 250, (1 + 3 * j + k,), generator=g).tolist() for j in range(group_size)]
        lps = [[-2.0 - 0.1 * i for i in range(len(c))] for c in comps]
        out.append(Group.sampled(prompt, comps, lps, [float(j % 2) + 0.3 * k for j in range(group_size)], 0.9))
    return out


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _micro_batch():
    """One micro-batch: two full groups of 3 with prompts of 3 and 5 tokens, and a lone sequence (a partial group)."""
    groups = [Group.sampled([5, 6, 7], [[10, 11, 12, 13], [14], [15, 16]], [None] * 3, [1.0, 0.0, 0.5], 1.0),
              Group.sampled([8, 9, 20, 21, 22], [[30, 31], [32, 33, 34, 35, 36], [37, 38, 39]], [None] * 3,
                            [0.0, 1.0, 1.0], 1.0),
              Group.sampled([40, 41], [[42, 43, 44]], [None], [1.0], 1.0)]
    return prepare_batch(groups, max_seq_len=64, micro_batch_size=64, pad_token_id=0,
                         advantage_norm="none").micro_batches[0]


def test_layout_forwards_each_prompt_once_with_continuing_positions():
    mb = _micro_batch()
    layout = prefix.shared_layout(mb.input_ids, mb.attention_mask, mb.labels)
    # Inputs drop each sequence's last token: prompt 3 + completions 3, 0, 1 = 7; prompt 5 + 1, 4, 2 = 12; 2 + 2.
    assert layout.lengths == [7, 12, 4]
    assert layout.input_ids[0, :7].tolist() == [5, 6, 7, 10, 11, 12, 15]
    assert layout.position_ids[0, :7].tolist() == [0, 1, 2, 3, 4, 5, 3]
    assert layout.position_ids[1, :12].tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 5, 6]
    allowed = layout.allowed[0, 0, :7, :7].int()
    assert allowed[6].tolist() == [1, 1, 1, 0, 0, 0, 1]  # the 3rd completion sees the prompt and itself only
    assert allowed[5].tolist() == [1, 1, 1, 1, 1, 1, 0]
    assert allowed[2].tolist() == [1, 1, 1, 0, 0, 0, 0]
    # The second sequence's one input token is the prompt's last: its first label reads the shared position 2.
    assert layout.index[1, :3].tolist() == [0, 1, 2] and layout.index[0, :3].tolist() == [0, 1, 2]
    assert prefix.shared_row_lengths(mb.attention_mask, mb.labels, mb.input_ids) == [7, 12, 4]
    assert not torch.isnan(layout.additive_mask(torch.float32)).any()


@pytest.mark.parametrize("attn", [None, "eager", "varlen"])
def test_shared_logprobs_and_gradients_equal_the_unshared_path(tiny_qwen2_dir, attn):
    from grpo.models.loading import set_attention

    model = _model(tiny_qwen2_dir)
    set_attention(model, attn)
    mb = _micro_batch()
    weights = torch.linspace(-1, 1, mb.labels.numel()).view_as(mb.labels)
    out = {}
    for shared in (False, True):
        lp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures, chunk_size=8,
                            shared=shared)
        (lp * weights).sum().backward()
        out[shared] = (lp.detach(), _grads(model))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
    assert (out[True][0][mb.labels == IGNORE_INDEX] == 0).all() and (out[True][0][mb.labels != IGNORE_INDEX] < 0).all()
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_a_mask_that_lets_completions_see_each_other_changes_the_logprobs(tiny_qwen2_dir, monkeypatch):
    """The equality above holds only with the right mask: completions that also attend to the earlier completions
    of their row give other log-probs (the check would catch a too-permissive mask)."""
    model = _model(tiny_qwen2_dir)
    mb = _micro_batch()
    args = (model, mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures)
    with torch.no_grad():
        right = token_logprobs(*args, shared=True)
        layout_of = prefix.shared_layout

        def leaky(*a):
            layout = layout_of(*a)
            causal = torch.ones_like(layout.allowed[0, 0]).tril()
            layout.allowed = layout.allowed | (causal & (layout.allowed.any(-1, keepdim=True)))
            return layout

        monkeypatch.setattr("grpo.trainer.hidden_states.shared_layout", leaky)
        wrong = token_logprobs(*args, shared=True)
    unshared = token_logprobs(*args)
    sel = mb.labels != IGNORE_INDEX
    torch.testing.assert_close(right[sel], unshared[sel].detach(), rtol=0, atol=1e-5)
    assert (wrong[sel] - right[sel]).abs().max() > 1e-3


@pytest.mark.parametrize("fused, aggregation", [(True, "token_mean"), (True, "seq_mean_token_mean"),
                                                (True, "seq_mean_token_sum_norm"), (False, "token_mean")])
def test_trainer_update_loss_and_gradients_equal_the_unshared_path(tiny_qwen2_dir, fused, aggregation):
    """Micro-batches of 3 rows over groups of 4: every micro-batch holds a partial group. pi_old recomputed."""
    model = _model(tiny_qwen2_dir)
    loss_fn = GRPOLoss(aggregation=aggregation, kl_coef=0.02, kl_reference="rollout", old_logprobs="recompute")
    out = {}
    for shared in (False, True):
        batch = prepare_batch(_groups(0), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
        trainer = update_trainer(model, loss_fn, fused_loss=fused, prefix_sharing=shared)
        assert trainer.fused == fused
        trainer.recompute_old_logprobs(batch)
        loss, metrics = trainer.forward_backward(batch)
        out[shared] = (loss, metrics, _grads(model), [mb.old_logprobs for mb in batch.micro_batches],
                       trainer.perf(batch, 1.0))
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5, abs=1e-6)
    assert out[True][1]["grpo/kl"] == pytest.approx(out[False][1]["grpo/kl"], rel=1e-4, abs=1e-6)
    for a, b in zip(out[True][3], out[False][3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for name, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], g, rtol=1e-5, atol=1e-5, msg=name)
    # The prompts that share a micro-batch are forwarded once: fewer tokens and FLOPs for the same trained tokens.
    assert out[True][4]["tokens/forwarded"] < out[False][4]["tokens/forwarded"]
    assert out[True][4]["perf/tflops"] < out[False][4]["perf/tflops"]


def test_mini_batches_that_split_groups_keep_loss_and_gradients(tiny_qwen2_dir):
    """train.mini_batches shuffles sequences across micro-batches: whichever share a prompt in one micro-batch share
    it, and each update's loss and gradients are the unshared path's."""
    model = _model(tiny_qwen2_dir)
    loss_fn = GRPOLoss(kl_coef=0.02, kl_reference="rollout")
    batch = prepare_batch(_groups(4, n_groups=4), max_seq_len=64, micro_batch_size=5, pad_token_id=0)
    minis = split_mini_batches(batch, 2, 5, random.Random(3))
    trainers = {s: update_trainer(model, loss_fn, prefix_sharing=s, mini_batches=2) for s in (False, True)}
    rows = [len(prefix.shared_row_lengths(mb.attention_mask, mb.labels, mb.input_ids))
            for mini in minis for mb in mini.micro_batches]
    assert sum(rows) < batch.num_sequences  # some sequences did share a prompt after the shuffle
    for mini in minis:
        got = {}
        for shared, trainer in trainers.items():
            got[shared] = (trainer.forward_backward(mini)[0], _grads(model))
        assert got[True][0] == pytest.approx(got[False][0], rel=1e-5, abs=1e-6)
        for name, g in got[False][1].items():
            torch.testing.assert_close(got[True][1][name], g, rtol=1e-5, atol=1e-5, msg=name)


def _cfg(**train):
    return OmegaConf.create({"model": {"attn_implementation": train.pop("attn", None)},
                             "train": {"prefix_sharing": True, "padding_free": False, **train}})


@pytest.mark.parametrize("attn", ["flash_attention_2", "flex_attention"])
def test_prefix_sharing_refuses_attention_kernels_without_a_4d_mask(attn):
    with pytest.raises(ConfigError, match=f"model.attn_implementation={attn} does not: set model.attn_implementation=sdpa"):
        check_prefix_sharing(_cfg(attn=attn))
    check_prefix_sharing(_cfg(attn="varlen"))
    check_prefix_sharing(_cfg(attn="eager"))


def test_prefix_sharing_refuses_padding_free_and_torchrun(monkeypatch):
    with pytest.raises(ConfigError, match="set train.padding_free=false"):
        check_prefix_sharing(_cfg(padding_free=True))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="single-process only"):
        check_prefix_sharing(_cfg())
    check_prefix_sharing(_cfg(prefix_sharing=False))  # off: nothing to check


def test_validate_refuses_prefix_sharing_with_padding_free(tmp_path):
    """The check runs in the start-up validation of the composed config (before any model loads)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs, validate

    register_configs()
    GlobalHydra.instance().clear()
    conf = CONFIG_DIR
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["train.prefix_sharing=true", "train.padding_free=true"],
                      return_hydra_config=True)
        with pytest.raises(ConfigError, match="train.prefix_sharing lays out its own rows"):
            validate(cfg, tmp_path / "run")


def test_prefix_sharing_refuses_sliding_window_models(tiny_qwen2_dir):
    model = _model(tiny_qwen2_dir)
    assert prefix.unsupported_reason(model) is None
    model.config.use_sliding_window = True
    assert "sliding-window" in prefix.unsupported_reason(model)
    from grpo.recipes.trainable_model import (
        check_prefix_sharing_model,  # what build_model calls after loading the model
    )

    with pytest.raises(ConfigError, match="sliding-window attention layers.*set train.prefix_sharing=false"):
        check_prefix_sharing_model(_cfg(), model)
    check_prefix_sharing_model(_cfg(prefix_sharing=False), model)

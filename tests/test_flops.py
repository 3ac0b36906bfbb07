"""The FLOP count of an update (`grpo.trainer.flops`): shapes from the model config, the formula's terms, the device
peak table and the padding share."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from grpo.trainer.flops import ModelFlops, pad_fraction, peak_tflops, perf_metrics


def _config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=1000)
    return SimpleNamespace(**{**base, **kw})


def test_shapes_from_a_gqa_config():
    f = ModelFlops.from_config(_config())
    head_dim = 16
    attn = 64 * head_dim * (4 + 2 * 2) + 4 * head_dim * 64  # q, k, v (2 kv heads), o
    assert f.body_params == 2 * (attn + 3 * 64 * 128)
    assert f.head_params == 64 * 1000 and f.layers == 2 and f.attn_width == 64
    assert ModelFlops.from_config(_config(head_dim=32)).attn_width == 128  # Qwen3: head_dim apart from hidden / heads


def test_train_flops_terms():
    f = ModelFlops(body_params=1000, head_params=500, layers=2, attn_width=8)
    dense = 6 * 1000 * (3 + 5)
    attention = 12 * 2 * 8 * (3 * 3 + 5 * 5)
    assert f.train_flops([3, 5], loss_tokens=4) == dense + attention + 6 * 500 * 4
    recompute = 2 * 1000 * 8 + 4 * 2 * 8 * (9 + 25)
    assert f.train_flops([3, 5], 4, recompute=True) == dense + attention + 6 * 500 * 4 + recompute
    # Attention is per sequence: one sequence of 8 costs more than two of 4.
    assert f.train_flops([8], 4) > f.train_flops([4, 4], 4)


def test_real_model_config(tiny_qwen2_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_qwen2_dir)
    f = ModelFlops.from_config(cfg)
    assert f.layers == cfg.num_hidden_layers and f.head_params == cfg.hidden_size * cfg.vocab_size


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", True) == 989.0
    assert peak_tflops("NVIDIA H200", True) == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", True) == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", False) == 67.0
    assert peak_tflops(None, True) is None  # CPU
    assert peak_tflops("Some Other GPU", True) is None


def test_perf_metrics_and_pad_fraction():
    m = perf_metrics(989e12, 2.0, 989.0)
    assert m["perf/tflops"] == pytest.approx(494.5) and m["perf/mfu"] == pytest.approx(0.5)
    assert math.isnan(perf_metrics(1e12, 1.0, None)["perf/mfu"])
    assert pad_fraction([[4, 2], [3]], packed=False) == pytest.approx(1 - 9 / 11)  # 2 x 4 + 1 x 3 tokens run
    assert pad_fraction([[4, 2], [3]], packed=True) == 0.0
    assert pad_fraction([], packed=False) == 0.0

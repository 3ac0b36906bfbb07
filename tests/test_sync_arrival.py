"""The sync's arrival check (issue 44.12) on hand-made tensors; against a real vLLM server: test_sync_modes.py."""

from __future__ import annotations

import torch

from grpo.sync.arrival import compare, probe_names, served_sums, tensor_sum


def test_probes_are_the_final_norm_and_the_first_and_last_blocks_unfused_projections():
    names = [f"model.layers.{i}.{m}" for i in range(3) for m in
             ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.up_proj.weight")]
    names += ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"]
    names += [f"model.layers.{i}.{m}.weight" for i in range(3) for m in ("input_layernorm", "post_attention_layernorm")]
    assert probe_names(names) == [
        "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.2.input_layernorm.weight", "model.layers.2.mlp.down_proj.weight",
        "model.layers.2.post_attention_layernorm.weight", "model.layers.2.self_attn.o_proj.weight",
        "model.norm.weight"]
    assert probe_names(["transformer.h.0.attn.c_proj.weight"]) == []  # another architecture: nothing to compare


def test_the_trainers_sum_is_taken_in_the_served_dtype():
    weights = torch.tensor([1.0 + 2**-10, 3.0])  # 1 + 2^-10 rounds to 1.0 in bf16
    assert tensor_sum(weights) == 4.0 + 2**-10
    assert tensor_sum(weights, torch.bfloat16) == 4.0


def test_sharded_parameters_add_their_shards_and_replicated_ones_count_once():
    workers = [{"norm": {"shape": [4], "sum": 2.0}, "o": {"shape": [4, 2], "sum": 1.5}},
               {"norm": {"shape": [4], "sum": 2.0}, "o": {"shape": [4, 2], "sum": 0.5}}]
    assert served_sums(workers, {"norm": [4], "o": [4, 4], "absent": [3]}) == {"norm": 2.0, "o": 2.0}


def test_compare_matches_equal_sums_only():
    assert compare({"a": 1.0, "b": -2.0}, {"a": 1.0, "b": -2.0}) == (True, 0.0)
    match, worst = compare({"a": 1.0, "b": -2.0}, {"a": 1.0, "b": -2.002})
    assert not match and abs(worst - 1e-3) < 1e-9
    assert compare({"a": 1.0}, {"b": 1.0})[0] is False  # nothing in common is no proof of arrival

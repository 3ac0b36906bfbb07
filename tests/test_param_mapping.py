"""HF <-> vLLM parameter mapping (shared_vllm), on CPU, against vLLM's real model classes for Qwen2 and Llama.

A subprocess builds vLLM's own model class for the tiny model and loads the HF checkpoint with vLLM's own
`load_weights` (which fuses q/k/v and gate/up and pads the vocabulary); the views our mapping builds into those
fused tensors must equal the HF tensors exactly and share their storage.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import free_port

VLLM_DUMP = r"""
import sys, torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import get_model_architecture
from safetensors.torch import load_file
model_dir, port, out = sys.argv[1], sys.argv[2], sys.argv[3]
mc = ModelConfig(model=model_dir, dtype="float32", max_model_len=256)
vc = VllmConfig(model_config=mc)
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)
    cls, _ = get_model_architecture(mc)
    model = cls(vllm_config=vc, prefix="")
    model.load_weights(load_file(f"{model_dir}/model.safetensors").items())
torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out)
"""


@pytest.fixture(scope="module", params=["tiny_qwen2_dir", "tiny_llama_dir"])
def vllm_and_hf(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(request.param)
    out = tmp_path_factory.mktemp("vllm_params") / "params.pt"
    subprocess.run([sys.executable, "-c", VLLM_DUMP, str(model_dir), str(free_port()), str(out)], check=True,
                   capture_output=True, timeout=180)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return torch.load(out), hf


def test_real_vllm_names_map_exactly(vllm_and_hf):
    from grpo.sync.param_mapping import build_views, plan_mapping

    vllm_params, hf = vllm_and_hf
    assert any(".qkv_proj." in n for n in vllm_params) and any(".gate_up_proj." in n for n in vllm_params)
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    plan = plan_mapping({n: p.shape for n, p in hf_params.items()}, {n: t.shape for n, t in vllm_params.items()},
                        hf.config)  # fmt: skip
    assert set(plan) == set(hf_params)  # every HF parameter mapped, lm_head included (tied or not)
    if hf.config.tie_word_embeddings:
        assert "lm_head.weight" not in vllm_params and plan["lm_head.weight"].vllm_name == "model.embed_tokens.weight"
    else:
        assert plan["lm_head.weight"].vllm_name == "lm_head.weight"
    views = build_views(plan, vllm_params)
    for name, p in hf_params.items():
        assert torch.equal(views[name], p.detach()), name
    # Views share vLLM's storage: an in-place optimizer update is seen by the fused tensor.
    q = views["model.layers.1.self_attn.k_proj.weight"]
    q.add_(1.0)
    fused = vllm_params["model.layers.1.self_attn.qkv_proj.weight"]
    q_rows = hf.config.num_attention_heads * (getattr(hf.config, "head_dim", None) or 64)
    assert torch.equal(fused[q_rows : q_rows + q.shape[0]], q)
    assert q.is_contiguous()


def test_lora_wrapped_names(vllm_and_hf):
    from grpo.sync.param_mapping import plan_mapping

    vllm_params, hf = vllm_and_hf
    wrapped = {n.replace("qkv_proj.weight", "qkv_proj.base_layer.weight"): t.shape for n, t in vllm_params.items()}
    plan = plan_mapping({n: p.shape for n, p in hf.named_parameters()}, wrapped, hf.config)
    assert plan["model.layers.0.self_attn.v_proj.weight"].vllm_name == "model.layers.0.self_attn.qkv_proj.weight"


def test_unmapped_is_an_error_never_zero_filled(vllm_and_hf):
    from grpo.sync.param_mapping import MappingError, plan_mapping

    vllm_params, hf = vllm_and_hf
    hf_shapes = {n: p.shape for n, p in hf.named_parameters()}
    vllm_shapes = {n: t.shape for n, t in vllm_params.items()}
    missing = {n: s for n, s in vllm_shapes.items() if "layers.2.mlp.down_proj" not in n}
    with pytest.raises(MappingError, match="layers.2.mlp.down_proj"):
        plan_mapping(hf_shapes, missing, hf.config)
    with pytest.raises(MappingError, match="extra.weight"):
        plan_mapping({**hf_shapes, "model.extra.weight": (3,)}, vllm_shapes, hf.config)
    with pytest.raises(MappingError, match="gate_up_proj.*not all of it"):
        plan_mapping({n: s for n, s in hf_shapes.items() if "layers.0.mlp.up_proj" not in n}, vllm_shapes, hf.config)
    bad = dict(vllm_shapes)
    bad["model.layers.0.self_attn.o_proj.weight"] = (7, 7)
    with pytest.raises(MappingError, match="o_proj"):
        plan_mapping(hf_shapes, bad, hf.config)

"""server.quantization=fp8 (vLLM serving the policy in FP8, quantized by vLLM from the synced weights): the start-up
checks, as on a machine with CUDA (the CPU engine has no FP8 kernels, so the serving itself is a GPU plan's:
bench/gpu/plans/fp8_rollouts_4gpu.txt), and the flag on vLLM's command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo.conf import CONFIG_DIR
from grpo.config import ConfigError, register_configs, validate

register_configs()

CORRECTED = ["loss.old_logprobs=recompute", "loss.tis_cap=2.0"]
FP8 = ["server=gpu", "server.quantization=fp8", "server.dtype=bfloat16", "model=qwen3b", "model.offline=qwen3b"]


def _validate(overrides: list[str], run_dir: Path, monkeypatch, cuda: bool = True) -> None:
    """Compose as train.py does and validate, with CUDA visible or not."""
    monkeypatch.setattr(sys.modules["grpo.config.validate"], "_cuda_available", lambda: cuda)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["~experiment", *overrides], return_hydra_config=True)
        validate(cfg, run_dir)


@pytest.mark.parametrize("mode", [["mode=none"], ["mode=none", "mode.reload=restart"],
                                  ["mode=broadcast", "server.device=1"]])
def test_fp8_with_a_reloading_sync_and_a_correction_passes(mode, tmp_path, monkeypatch):
    _validate([*FP8, *mode, *CORRECTED], tmp_path / "run", monkeypatch)
    _validate([*FP8, *mode, "loss.token_mask=[0.5,2.0]"], tmp_path / "run2", monkeypatch)


@pytest.mark.parametrize("mode, needle", [
    (["mode=shared_vllm"], "server.quantization=fp8 with mode=shared_vllm: shared_vllm trains vLLM's own tensors"),
    (["mode=lora_only"], "server.quantization=fp8 with mode=lora_only: its base weights are loaded once"),
    (["mode=lora_restart"], "server.quantization=fp8 with mode=lora_restart: its base weights are loaded once"),
    (["mode=broadcast", "server.device=1", "mode.receive=direct"], "use mode.receive=engine with server.quantization"),
])
def test_fp8_refused_where_the_sync_does_not_reload_through_vllms_loader(mode, needle, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="use mode=none or mode=broadcast|mode.receive=engine") as e:
        _validate([*FP8, *mode, *CORRECTED], tmp_path / "run", monkeypatch)
    assert needle in str(e.value)


def test_fp8_without_an_off_policy_correction_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"samples rollouts from FP8 weights .* loss.old_logprobs=recompute with "
                                          r"loss.tis_cap=2.0"):
        _validate([*FP8, "mode=none"], tmp_path / "run", monkeypatch)


@pytest.mark.parametrize("overrides, cuda, needle", [
    (["server=cpu", "server.quantization=fp8", "mode=none", *CORRECTED], False,
     "needs vLLM on a CUDA GPU (its CPU engine has no FP8 kernels)"),
    (["mode=none", *CORRECTED, "server.quantization=int4"], True, "server.quantization=int4 is not one of fp8"),
    (["mode=none", *CORRECTED, "server.extra_args=[--quantization,fp8]"], True, "--quantization in server.extra_args"),
    (["mode=none", *CORRECTED, "server.external_url=http://127.0.0.1:9"], True, "start that server with --quantization"),
])
def test_fp8_setting_errors(overrides, cuda, needle, tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as e:
        _validate(overrides if "server=cpu" in overrides else [*FP8, *overrides], tmp_path / "run", monkeypatch,
                  cuda=cuda)
    assert needle in str(e.value)


def test_fp8_reaches_vllms_command_line(tmp_path):
    from grpo.inference.process import VLLMServer
    from grpo.schema import ServerConfig

    def command(**overrides):
        return VLLMServer("m", ServerConfig(port=8000, **overrides), tmp_path / "vllm.log").command()

    args = command(quantization="fp8")
    assert args[args.index("--quantization") + 1] == "fp8"
    assert "--quantization" not in command()


def test_arrival_check_compares_only_the_weights_vllm_serves_unquantized():
    """An FP8 weight's served sum (scaled 8-bit values) is left out of the fingerprint; the norms still compare."""
    import torch

    from grpo.sync.arrival import check_arrival

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.norm = torch.nn.Module()
    model.model.norm.weight = torch.nn.Parameter(torch.full((4,), 0.5))
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    block = model.model.layers[0]
    block.mlp = torch.nn.Module()
    block.mlp.down_proj = torch.nn.Linear(4, 4, bias=False)

    class Client:  # the worker's answer for an FP8 server: the norm as is, the projection in float8 (another sum)
        def weight_version(self):
            return 3

        def rpc(self, name, names):
            return [{"model.norm.weight": {"shape": [4], "dtype": "bfloat16", "sum": 2.0},
                     "model.layers.0.mlp.down_proj.weight": {"shape": [4, 4], "dtype": "float8_e4m3fn", "sum": 99.0}}]

    out = check_arrival(model, Client(), 3)
    assert out["sync/weights_match"] == 1.0 and out["sync/weights_max_rel_diff"] == 0.0

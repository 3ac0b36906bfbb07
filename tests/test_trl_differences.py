"""bench/trl_arith.py lists every difference between TRL's run and ours beside each result: the ones that follow from
our composed experiment (asynchronous rollouts, the work-saving switches) must appear exactly when the experiment
has them, or a reader compares an asynchronous run to a synchronous one without being told; the GPU run's list is
the GPU set-up's, and what the harness sets equal (gradient checkpointing, the sampler's dtype) is set."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import trl_arith  # noqa: E402


def test_the_one_gpu_experiments_async_rollouts_and_work_savings_are_listed():
    found = trl_arith.config_differences(trl_arith.compose_ours([], "smollm2_chat_arith_shared"))
    assert any(d.startswith("rollouts: ours asynchronous (train.max_staleness=1") for d in found)
    assert any(d.startswith("work per step:") for d in found)
    assert any(d.startswith("rollout batches generating at once: ours 2") for d in found)


def test_one_batch_in_flight_lists_no_batches_difference():
    cfg = trl_arith.compose_ours(["train.rollout_batches_in_flight=1"], "smollm2_chat_arith_shared")
    assert not any(d.startswith("rollout batches generating at once") for d in trl_arith.config_differences(cfg))


def test_a_synchronous_run_without_work_savings_lists_neither():
    cfg = trl_arith.compose_ours(["train.max_staleness=0", "train.rollout_batches_in_flight=1", "train.prefix_sharing=false",
                                  "train.skip_zero_advantage=false"], "smollm2_chat_arith_shared")
    assert trl_arith.config_differences(cfg) == []


# ---------------------------------------------------------------- the GPU run (--vllm)
def test_the_gpu_runs_list_is_the_gpu_set_ups_not_the_cpus():
    cfg = trl_arith.compose_ours([], "smollm2_chat_arith_shared")
    gpu, cpu = trl_arith.differences(cfg, vllm=True), trl_arith.differences(cfg, vllm=False)
    assert set(trl_arith.GPU_DIFFERENCES) <= set(gpu) and not set(trl_arith.CPU_DIFFERENCES) & set(gpu)
    assert set(trl_arith.CPU_DIFFERENCES) <= set(cpu) and not set(trl_arith.GPU_DIFFERENCES) & set(cpu)
    # What the GPU run sets equal is no difference: the CPU engine, transformers generation and threads are not there.
    assert not any("CPU engine" in d or "threads" in d for d in gpu)
    assert any("vllm_importance_sampling_correction=True" in d for d in gpu)


def _gpu_settings(tmp_path, *overrides):
    cfg = trl_arith.compose_ours(list(overrides), "smollm2_chat_arith_shared")
    return cfg, trl_arith.trl_settings(cfg, steps=250, eval_every=int(cfg.eval.every), seed=0, vllm=True,
                                       checkpoints=str(tmp_path / "trl"), reward_weights=[1.0, 0.0], use_cpu=True)


def test_trl_recomputes_as_ours_keeps_its_importance_correction_and_saves_at_the_eval_steps(tmp_path):
    cfg, settings = _gpu_settings(tmp_path)
    assert settings["gradient_checkpointing"] is False is cfg.model.gradient_checkpointing
    assert _gpu_settings(tmp_path, "model.gradient_checkpointing=true")[1]["gradient_checkpointing"] is True
    assert "vllm_importance_sampling_correction" not in settings  # left to TRL's default
    assert (settings["save_strategy"], settings["save_steps"], settings["save_only_model"]) == ("steps", 50, True)
    assert settings["output_dir"] == str(tmp_path / "trl")
    trl = pytest.importorskip("trl")
    config = trl.GRPOConfig(**settings)
    # TRL's default is what the differences list says it is, and what runs.
    assert config.vllm_importance_sampling_correction is True and config.gradient_checkpointing is False
    assert trl.GRPOConfig.__dataclass_fields__["gradient_checkpointing"].default is True  # why the harness sets it


def test_trls_sampler_gets_our_dtype(monkeypatch):
    made = []
    generation = types.ModuleType("trl.generation.vllm_generation")
    generation.LLM = lambda *args, **kwargs: made.append(kwargs)
    monkeypatch.setitem(sys.modules, "trl.generation.vllm_generation", generation)
    trl_arith.sample_in("auto")  # TRL's own: left alone
    generation.LLM(model="m")
    trl_arith.sample_in("float32")
    generation.LLM(model="m", max_model_len=1024)
    assert made == [{"model": "m"}, {"model": "m", "max_model_len": 1024, "dtype": "float32"}]

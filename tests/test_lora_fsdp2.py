"""LoRA under FSDP2 on 2 gloo processes: the loss, the KL against the adapter-off reference and the adapter after a
step equal one process's; the sync gathers the adapter alone (its bytes counted in the sync's metrics), and a
checkpoint holds the adapter alone and resumes into a sharded model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from grpo.sync.base import SyncContext
from grpo.sync.follower import FollowerSync
from grpo.sync.lora_hotswap import LoraHotSwapSync
from grpo.trainer.metrics import NullMetrics

# The equality tests share one fixture, ~21 s on an idle 2-core host (one process, then two spawned gloo ranks, each
# importing torch and transformers); the torchrun run below starts vLLM twice, ~4 min there under load.
pytestmark = pytest.mark.slow


class _AdapterSync(LoraHotSwapSync):
    """Rank 0's mode=lora_only with the server's load left out: what is tested is what the sync gathers and saves
    (the real `sync` and `save_adapter`); the served adapter's loading is tests/test_sync_modes.py's."""

    def __init__(self, run_dir: Path, model_dir: str) -> None:
        super().__init__()
        self.ctx = SyncContext(run_dir=run_dir, model_dir=Path(model_dir), server_cfg=None)
        self.saved: list[Path] = []

    def _swap_in(self, out: Path, version: int) -> None:
        self.saved.append(out)


def _lora_model(model_dir: str, sharded: bool):
    """tiny-qwen2 with a rank-8 adapter on every linear layer; B seeded away from 0 so A's gradient is not 0 either
    and the adapter-off reference differs from the policy (a KL that is not 0)."""
    from transformers import AutoModelForCausalLM

    from grpo.schema.model import LoraConfig
    from grpo.trainer import fsdp
    from grpo.trainer.layers import apply_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])
    model = apply_lora(model, lora, list(range(model.config.num_hidden_layers)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    if sharded:
        fsdp.shard_model(model)
    return model


def _lora_step(rank: int, world: int, port: int, model_dir: str, out_root: str) -> None:
    """One optimizer step of a LoRA model (KL penalty against the adapter-off reference), its sync and checkpoint;
    then a fresh model resumed from that checkpoint. Rank 0 writes what the test compares."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from grpo.pipeline.rank_broadcast import FollowerPipeline, LeaderPipeline
    from grpo.schema import LoggingConfig, TrainConfig
    from grpo.trainer import fsdp
    from grpo.trainer.checkpoint import CheckpointManager
    from grpo.trainer.loop import GRPOTrainer
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.metrics import MetricsLogger
    from grpo.trainer.optim import build_scheduler
    from grpo.trainer.reference import ReferencePolicy
    from grpo.weights.params import full_trainable_params
    from test_distributed import _Pipeline

    info = fsdp.init_from_env("cpu")
    run_dir = Path(out_root) / f"world{world}_rank{rank}"
    run_dir.mkdir(parents=True)
    model = _lora_model(model_dir, info.enabled)
    logprob_fn = fsdp.sharded_token_logprobs(model) if info.enabled else None
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    cfg = OmegaConf.structured(TrainConfig(steps=1, micro_batch_size=2, grad_accum=3, checkpoint_every=1,
                                           max_grad_norm=None))
    rank0 = rank == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = _Pipeline(tokenizer.pad_token_id)
    pipeline = source if not info.enabled else (LeaderPipeline(source) if rank0 else FollowerPipeline())
    sync = _AdapterSync(run_dir, model_dir) if rank0 else FollowerSync(gather=LoraHotSwapSync.fsdp_gather,
                                                                        uses_lora=True)
    trainer = GRPOTrainer(
        train_cfg=cfg, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, "constant", 0, 1), loss_fn=GRPOLoss(kl_coef=0.1), pipeline=pipeline,
        sync=sync, checkpoints=CheckpointManager(run_dir, keep=1),
        metrics=MetricsLogger(run_dir, OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False)), cfg, 1, 0)
        if rank0 else NullMetrics(),
        device=info.device, start_step=0, dist=info, reference=ReferencePolicy.adapter_off(model, logprob_fn),
        logprob_fn=logprob_fn,
    )
    trainer.fit()
    trainer.metrics.close()
    after, _ = full_trainable_params(model)
    # Resume: a fresh adapter (other values) sharded the same way takes the checkpoint's.
    fresh = _lora_model(model_dir, info.enabled)
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(1.0)
    fresh_optimizer = torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    checkpoints = CheckpointManager(Path(out_root) / f"world{world}_rank0")
    ckpt = checkpoints.latest() if rank0 else None
    load = checkpoints.load_distributed if info.enabled else checkpoints.load
    state = load(fsdp.broadcast_object(ckpt), fresh, fresh_optimizer)
    resumed, _ = full_trainable_params(fresh)
    if rank0:
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        keep = ("loss", "grad_norm", "grpo/kl", "sync/adapter_bytes", "sync/gathered_bytes")
        (Path(out_root) / f"result_world{world}.json").write_text(json.dumps(
            {**{k: row[k] for k in keep}, "adapter_dir": str(sync.saved[-1]), "resumed_step": state["step"],
             "checkpoint": str(ckpt), "model_dir": model_dir,
             "base_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)}))
        torch.save({"after": after, "resumed": resumed}, Path(out_root) / f"adapter_world{world}.pt")
    if info.enabled:
        torch.distributed.barrier()  # both ranks leave together (tests/test_distributed.py::_train_one_step)
    fsdp.destroy()


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_qwen2_dir) -> Path:
    from conftest import one_process_then_two_gloo_ranks

    out = tmp_path_factory.mktemp("lora_fsdp2")
    one_process_then_two_gloo_ranks(_lora_step, tiny_qwen2_dir, out)
    return out


def test_lora_under_fsdp2_matches_one_process(lora_runs):
    """Loss, KL against the adapter-off reference, gradient norm and the adapter after the step (the one the sync
    saved for vLLM) equal one process's."""
    from safetensors.torch import load_file

    one = json.loads((lora_runs / "result_world1.json").read_text())
    two = json.loads((lora_runs / "result_world2.json").read_text())
    assert one["loss"] != 0 and one["grpo/kl"] > 1e-4
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert two["grpo/kl"] == pytest.approx(one["grpo/kl"], rel=1e-4)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    served_one = load_file(Path(one["adapter_dir"]) / "adapter_model.safetensors")
    served_two = load_file(Path(two["adapter_dir"]) / "adapter_model.safetensors")
    assert served_one.keys() == served_two.keys() and any("lora_A" in k for k in served_one)
    assert not any("lora" not in k for k in served_two)  # the adapter only, no base weight
    for name in served_one:
        torch.testing.assert_close(served_two[name], served_one[name], atol=1e-6, rtol=1e-5, msg=name)
    # The step moved both factors (B starts away from 0, so A has a gradient too).
    initial = {k: v for k, v in _lora_model(one["model_dir"], False).named_parameters() if v.requires_grad}
    after = torch.load(lora_runs / "adapter_world2.pt")["after"]
    assert after.keys() == initial.keys()
    moved = {k for k in after if not torch.allclose(after[k], initial[k].detach())}
    assert any("lora_A" in k for k in moved) and any("lora_B" in k for k in moved)


def test_lora_fsdp2_sync_gathers_the_adapter_alone(lora_runs, tiny_qwen2_dir):
    """The sync's all-gathers move exactly the adapter's bytes (counted in its metrics), never the frozen base."""
    one = json.loads((lora_runs / "result_world1.json").read_text())
    two = json.loads((lora_runs / "result_world2.json").read_text())
    model = _lora_model(str(tiny_qwen2_dir), False)
    adapter = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    assert two["sync/adapter_bytes"] == one["sync/adapter_bytes"] == adapter
    assert two["sync/gathered_bytes"] == adapter and one["sync/gathered_bytes"] == 0  # one process gathers nothing
    assert two["base_bytes"] > 5 * adapter  # a gather of the full weights would have shown


def test_lora_fsdp2_checkpoint_holds_the_adapter_and_resumes(lora_runs):
    """The checkpoint of the sharded LoRA run is the one-process format (the adapter alone); loading it into a fresh
    sharded model gives back the trained adapter on every rank's shards."""
    one_ckpt = Path(json.loads((lora_runs / "result_world1.json").read_text())["checkpoint"])
    two = json.loads((lora_runs / "result_world2.json").read_text())
    ckpt = Path(two["checkpoint"])
    assert two["resumed_step"] == 1
    assert {p.name for p in ckpt.iterdir()} == {p.name for p in one_ckpt.iterdir()} | {"rng_ranks.pt"}
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "adapter_model.safetensors").exists()
    adapters = torch.load(lora_runs / "adapter_world2.pt")
    assert adapters["after"].keys() == adapters["resumed"].keys()
    for name, t in adapters["after"].items():
        torch.testing.assert_close(adapters["resumed"][name], t, atol=0, rtol=0, msg=name)


@pytest.mark.vllm
def test_torchrun_two_ranks_lora_only_trains_syncs_the_adapter_and_resumes(tmp_path):
    """`torchrun --nproc-per-node 2 train.py mode=lora_only` end to end on the CPU (a vLLM server of its own): every
    sync gathers the adapter alone and hot-swaps it, with a KL penalty against the adapter-off reference; the
    checkpoints hold the adapter, and a resume goes on from them with the served version carried over."""
    import subprocess
    import sys
    import uuid

    from conftest import free_port
    from test_train_e2e import QUICK, assert_clean, metrics

    repo = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"

    def torchrun(*overrides):
        marker = f"GRPO_TEST_{uuid.uuid4().hex}"
        env = dict(os.environ, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(repo / "train.py"), "mode=lora_only", "server=cpu", *QUICK, "lora.r=8",
               "loss.kl_coef=0.05", "train.checkpoint_every=1", f"hydra.run.dir={run_dir}", *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, timeout=540, env=env)
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
        assert_clean(marker)

    torchrun("train.steps=2")
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and [r["sync/served_version"] for r in rows] == [1.0, 2.0]
    assert all(0 < r["sync/gathered_bytes"] == r["sync/adapter_bytes"] for r in rows)
    assert rows[0]["grpo/kl"] == 0.0 < rows[1]["grpo/kl"]  # the adapter moved away from the reference
    ckpt = run_dir / "checkpoints" / "step_000002"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    torchrun("train.steps=3", f"train.resume={run_dir}")
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["sync/served_version"] == 3.0

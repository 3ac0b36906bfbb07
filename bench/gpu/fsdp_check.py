"""FSDP2 on N GPUs gives the same loss, gradient norm and update as 1 GPU on the same batch.

    torchrun --nproc-per-node 1 bench/gpu/fsdp_check.py --out $OUT/fsdp_world1.json
    torchrun --nproc-per-node 2 bench/gpu/fsdp_check.py --out $OUT/fsdp_world2.json
    python bench/gpu/fsdp_check.py --compare $OUT/fsdp_world1.json $OUT/fsdp_world2.json

One GRPO step of the project's own loop (GRPOTrainer: rank 0 broadcasts the groups, each rank trains its share of
the micro-batches, FSDP2 reduce-scatters the gradients, loss and metrics are summed over ranks) on fixed groups;
SGD so the update is exactly lr x gradient. Rank 0 then gathers the full weights (`iter_full_params`, what the
broadcast sync sends) and records a checksum.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
from grpo.pipeline.base import DataPipeline  # noqa: E402  (after the sys.path insert)
from grpo.sync.base import SyncStrategy  # noqa: E402
from grpo.trainer.train_batch import IGNORE_INDEX  # noqa: E402


def groups(n_groups: int = 4, group_size: int = 4, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(0, 250, (8,), generator=g).tolist()
        tokens, masks, lps = [], [], []
        for j in range(group_size):
            comp = torch.randint(0, 250, (6 + j,), generator=g).tolist()
            tokens.append(prompt + comp)
            masks.append([IGNORE_INDEX] * len(prompt) + comp)
            lps.append([1.0] * len(prompt) + [-1.5 - 0.1 * i for i in range(len(comp))])
        out.append({"tokens": tokens, "masks": masks, "scores": [float(j % 3) + k for j in range(group_size)],
                    "advantages": None, "ref_logprobs": None, "inference_logprobs": lps,
                    "generation_params": None, "overrides": None, "group_overrides": None, "messages": None,
                    "env_id": 0})
    return out


class Pipeline(DataPipeline):
    """The same fixed groups every step."""

    def __init__(self, pad_token_id: int) -> None:
        from types import SimpleNamespace

        from grpo.pipeline.base import BatchShape

        self.ctx = SimpleNamespace(batch_shape=BatchShape(micro_batch_size=2, max_seq_len=64, pad_token_id=pad_token_id))

    def setup(self, ctx):
        pass

    def next_groups(self, step):
        return groups()


class GatherSync(SyncStrategy):
    """Rank 0's stand-in for mode=broadcast: gathers every full parameter, sends nothing."""

    fsdp_gather = "params"

    def __init__(self):
        super().__init__()
        self.checksum, self.seconds = 0.0, 0.0

    def launch(self, ctx):
        pass

    @property
    def base_url(self):
        return "http://unused"

    def shutdown(self):
        pass

    def sync(self, model, step):
        from grpo.weights.params import iter_full_params

        t0 = time.perf_counter()
        self.checksum = sum(float(t.double().abs().sum() + t.double().sum()) for _, t in iter_full_params(model))
        self.seconds = time.perf_counter() - t0
        self.version += 1
        return {"sync/seconds": self.seconds, "sync/version": float(self.version)}


def run(out: str, preset: str, device: str = "cuda") -> None:
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.models.tiny import build_model_dir
    from grpo.pipeline.rank_broadcast import FollowerPipeline, LeaderPipeline
    from grpo.schema import LoggingConfig, TrainConfig
    from grpo.sync.follower import FollowerSync
    from grpo.trainer import fsdp
    from grpo.trainer.checkpoint import CheckpointManager
    from grpo.trainer.loop import GRPOTrainer
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.metrics import MetricsLogger, NullMetrics
    from grpo.trainer.optim import build_scheduler

    torch.manual_seed(0)
    info = fsdp.init_from_env(device)
    if info.enabled and not info.is_rank0:
        torch.distributed.barrier()
    model_dir = build_model_dir(preset, seed=0, dtype="float32")
    if info.enabled and info.is_rank0:
        torch.distributed.barrier()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(info.device)
    if info.enabled:
        fsdp.shard_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = OmegaConf.structured(TrainConfig(steps=1, micro_batch_size=2, grad_accum=4, checkpoint_every=1000,
                                           max_grad_norm=None))
    rank0 = info.is_rank0
    run_dir = Path(out).parent / f"fsdp_run_world{info.world_size}"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id
    pipeline = Pipeline(pad) if not info.enabled else (LeaderPipeline(Pipeline(pad)) if rank0 else FollowerPipeline())
    sync = GatherSync() if rank0 else FollowerSync()
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
    metrics = (MetricsLogger(run_dir, OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False)), cfg, 1, 0)
               if rank0 else NullMetrics())
    trainer = GRPOTrainer(
        train_cfg=cfg, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, "constant", 0, 1), loss_fn=GRPOLoss(), pipeline=pipeline, sync=sync,
        checkpoints=CheckpointManager(run_dir, keep=1), metrics=metrics, device=info.device,
        start_step=0, dist=info, logprob_fn=fsdp.sharded_token_logprobs(model) if info.enabled else None,
    )
    t0 = time.perf_counter()
    trainer.fit()
    metrics.close()
    if rank0:
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        Path(out).write_text(json.dumps({
            "world_size": info.world_size, "preset": preset, "loss": row["loss"], "grad_norm": row["grad_norm"],
            "logprob_diff": row["grpo/logprob_diff"], "checksum_after_step": sync.checksum,
            "gather_seconds": sync.seconds, "step_seconds": time.perf_counter() - t0,
            "device": torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu"}, indent=1))
    fsdp.destroy()


def compare(a: str, b: str) -> None:
    x, y = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    res = {"world_sizes": [x["world_size"], y["world_size"]],
           "loss": [x["loss"], y["loss"]], "loss_abs_diff": abs(x["loss"] - y["loss"]),
           "grad_norm_rel_diff": abs(x["grad_norm"] - y["grad_norm"]) / max(abs(x["grad_norm"]), 1e-12),
           "checksum_rel_diff": abs(x["checksum_after_step"] - y["checksum_after_step"]) / abs(x["checksum_after_step"])}
    res["same_within_1e-5"] = res["loss_abs_diff"] < 1e-5 and res["grad_norm_rel_diff"] < 1e-5 and res["checksum_rel_diff"] < 1e-5
    print(json.dumps(res))
    Path(a).with_name("fsdp_compare.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--preset", default="tiny-qwen2")
    p.add_argument("--compare", nargs=2)
    p.add_argument("--device", default="cuda", help="cpu runs it on gloo (a smoke test)")
    a = p.parse_args()
    compare(*a.compare) if a.compare else run(a.out, a.preset, a.device)

"""MFU of the trainer's update at a real model size with a realistic spread of sequence lengths, per micro-batching.

    python bench/gpu/mfu_bench.py --preset qwen3b --out mfu_qwen3b.json [--configs rows16,budget_padded,...]

The measured code is the trainer's own: ``GRPOTrainer.plan`` (the token-budget split) and ``GRPOTrainer.update``
(forward + backward over the micro-batches, clip, AdamW step), and the figures are the ones it logs every step
(``perf/mfu``, ``perf/tflops``, ``batch/pad_fraction``, ``time/train_seconds``). No server: the rollouts are
synthetic, built with ``prepare_batch`` as the local pipeline builds them.

Length spread (the "realistic" one of issue 19): 8 prompts x 8 completions per update (64 sequences); a group's
prompt has 64-384 tokens (uniform), its completions are log-normal with a median of 256 tokens and sigma 0.6,
clipped to [16, 1024] (mean ~300, a long tail: the longest of 64 is typically 3-4x the median), as a reasoning task
sampled from an instruct model gives. Each update draws a new batch (seeded), the same sequence for every
configuration. Model: random bf16 weights of the preset, gradient checkpointing on, torch AdamW (lr 1e-6),
``conf/loss/grpo.yaml``. Each configuration runs in its own process (clean compile caches and memory peaks): 2
warm-up updates (FlexAttention compiles on the first, and again for dynamic shapes on the second), then ``--steps``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]

# name: (train.* overrides, model.attn_implementation)
CONFIGS = {
    "rows16": ({"micro_batch_size": 16, "grad_accum": 4}, None),
    "budget_padded": ({"max_tokens_per_micro_batch": 16384}, None),
    "budget_packed_sdpa": ({"max_tokens_per_micro_batch": 16384, "padding_free": True}, None),
    "budget_packed_flex": ({"max_tokens_per_micro_batch": 16384, "padding_free": True}, "flex_attention"),
    "budget32k_packed_flex": ({"max_tokens_per_micro_batch": 32768, "padding_free": True}, "flex_attention"),
    # train.logprob_chunk 4096 instead of 512: fewer, larger LM-head matmuls in the fused log-prob + loss.
    "budget_padded_chunk4k": ({"max_tokens_per_micro_batch": 16384, "logprob_chunk": 4096}, None),
    "budget32k_packed_flex_chunk4k": ({"max_tokens_per_micro_batch": 32768, "padding_free": True, "logprob_chunk": 4096},
                                      "flex_attention"),
    # model.attn_implementation=varlen: PyTorch's flash varlen kernel on the packed rows (no mask, no compile).
    "budget16k_packed_varlen": ({"max_tokens_per_micro_batch": 16384, "padding_free": True}, "varlen"),
    "budget32k_packed_varlen": ({"max_tokens_per_micro_batch": 32768, "padding_free": True}, "varlen"),
    # train.entropy_metric=false: the same update without grpo/entropy's pass over each chunk of logits (its cost).
    "budget16k_packed_varlen_noentropy": ({"max_tokens_per_micro_batch": 16384, "padding_free": True,
                                           "entropy_metric": False}, "varlen"),
    # + model.compile (a name ending in "+compile"): torch.compile of each decoder block.
    "budget16k_packed_varlen+compile": ({"max_tokens_per_micro_batch": 16384, "padding_free": True}, "varlen"),
    "budget32k_packed_varlen+compile": ({"max_tokens_per_micro_batch": 32768, "padding_free": True}, "varlen"),
}


def rollout_groups(seed: int, vocab: int, prompts: int = 8, group_size: int = 8, spread: str = "reasoning") -> list:
    """One update's groups: random tokens with the spread of lengths described in the module docstring
    (``reasoning``), or the whole-step benchmark's shape (``short``: 7-token prompts, 128-token completions)."""
    import numpy as np

    from grpo.pipeline.group import Group

    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(prompts):
        if spread == "short":
            prompt, lengths = rng.integers(3, vocab, 7).tolist(), np.full(group_size, 128)
        else:
            prompt = rng.integers(3, vocab, int(rng.integers(64, 385))).tolist()
            lengths = np.clip(np.round(rng.lognormal(np.log(256), 0.6, group_size)), 16, 1024).astype(int)
        comps = [rng.integers(3, vocab, n).tolist() for n in lengths]
        # Rollout log-probs near a random model's (log 1/vocab), so the PPO ratio stays finite and unclipped.
        lps = [(-np.log(vocab) + 0.01 * rng.standard_normal(n)).tolist() for n in lengths]
        groups.append(Group.sampled(prompt, comps, lps, rng.random(group_size).tolist(), 1.0))
    return groups


class _NoServer:
    """The trainer's sync hooks with no server behind them."""

    version = 0

    def before_optimizer_step(self) -> None: ...

    def after_optimizer_step(self) -> None: ...


def one(preset: str, name: str, steps: int, device_name: str = "cuda", spread: str = "reasoning",
        profile: bool = False) -> dict:
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT / "src"))
    from grpo.models.loading import compile_decoder_layers, load_model, set_attention
    from grpo.models.tiny import build_model_dir
    from grpo.pipeline.batching import prepare_batch
    from grpo.schema import TrainConfig
    from grpo.trainer.loop import GRPOTrainer
    from grpo.trainer.metrics import NullMetrics
    from grpo.trainer.optim import build_optimizer

    train, attn = CONFIGS[name]
    if os.environ.get("MFU_STACKS_AFTER_S"):  # where a configuration hangs: every thread's stack on stderr
        faulthandler.dump_traceback_later(float(os.environ["MFU_STACKS_AFTER_S"]), repeat=True)
    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(str(build_model_dir(preset, dtype=str(dtype).removeprefix("torch."))), dtype, device, True)
    set_attention(model, attn)
    if name.endswith("+compile"):
        compile_decoder_layers(model)
    loss_cfg = OmegaConf.load(ROOT / "conf/loss/grpo.yaml")
    loss_cfg.pop("defaults")
    fused = {"fused": True} if os.environ.get("MFU_FUSED_ADAMW") == "1" else {}
    opt = build_optimizer(model, {"_target_": "torch.optim.AdamW", "lr": 1e-6, "weight_decay": 0.0, **fused})
    cfg = OmegaConf.structured(TrainConfig(steps=10**6, **{"micro_batch_size": 64, "grad_accum": 1, **train}))
    trainer = GRPOTrainer(
        train_cfg=cfg, model=model, tokenizer=None, optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), loss_fn=instantiate(loss_cfg),
        pipeline=SimpleNamespace(), sync=_NoServer(), checkpoints=None, metrics=NullMetrics(), device=device,
    )  # fmt: skip
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for step in range(2 + steps):
        batch = prepare_batch(rollout_groups(step, vocab, spread=spread), max_seq_len=4096,
                              micro_batch_size=cfg.micro_batch_size, pad_token_id=0, vocab_size=vocab)  # fmt: skip
        prof = torch.profiler.profile() if profile and step == 2 + steps - 1 else None  # the last update
        sync()
        t0 = time.perf_counter()
        with prof or contextlib.nullcontext():
            for _, mini in trainer.plan(batch):
                row = trainer.update(mini)
            sync()
        if prof is not None:
            sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            profile_table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
            print(profile_table, file=sys.stderr, flush=True)
        print(f"update {step}: {time.perf_counter() - t0:.2f} s, mfu {row['perf/mfu']:.3f}", file=sys.stderr, flush=True)
        rows.append({**{k: row[k] for k in ("perf/mfu", "perf/tflops", "batch/pad_fraction", "batch/micro_batches",
                                             "time/train_seconds", "tokens/trained")},
                     "forward_tokens": float(batch.metrics["tokens/total"]), "wall_s": time.perf_counter() - t0})
    steady = rows[2:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    return {
        "config": name, "train": train, "attn_implementation": attn or "sdpa (default)",
        "compile": name.endswith("+compile"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "steps": rows,
        "median_mfu": med("perf/mfu"), "median_tflops": med("perf/tflops"), "median_train_s": med("time/train_seconds"),
        "median_pad_fraction": med("batch/pad_fraction"), "median_micro_batches": med("batch/micro_batches"),
        "trained_tokens_per_s": sum(r["tokens/trained"] for r in steady) / sum(r["time/train_seconds"] for r in steady),
        "forward_tokens_per_s": sum(r["forward_tokens"] for r in steady) / sum(r["time/train_seconds"] for r in steady),
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1024**3 if device.type == "cuda" else None,
        "spread": spread, "fused_adamw": bool(fused), **({"profile": profile_table} if profile else {}),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3b")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cpu for a smoke run with a tiny preset")
    p.add_argument("--timeout", type=int, default=420, help="seconds per configuration (compiles included)")
    p.add_argument("--spread", default="reasoning", choices=["reasoning", "short"],
                   help="sequence lengths: reasoning (module docstring) or short (the whole-step benchmark's 7 + 128)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of the last update")
    p.add_argument("--out", required=True)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.preset, args.one, args.steps, args.device, args.spread, args.profile)))
        return
    results = []
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--preset", args.preset, "--one", name, "--steps", str(args.steps), "--device",
               args.device, "--spread", args.spread, "--out", "-", *(["--profile"] if args.profile else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired as e:  # the steps it finished are on its stderr
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            results.append({"config": name, "error": f"timed out after {args.timeout} s", "stderr": err[-3000:]})
        except (IndexError, json.JSONDecodeError):
            results.append({"config": name, "error": proc.stderr[-3000:]})
        summary = {k: v for k, v in results[-1].items() if k not in ("steps", "profile")}
        print(json.dumps(summary), flush=True)
        Path(args.out).write_text(json.dumps({"preset": args.preset, "results": results}, indent=2))


if __name__ == "__main__":
    main()

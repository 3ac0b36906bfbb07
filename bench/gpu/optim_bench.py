"""Trained tokens/s and peak memory of one GRPO train step per optimizer, at a real model size, on one GPU.

    python bench/gpu/optim_bench.py --preset qwen3b --out optim_qwen3b.json [--optimizers adamw,adamw_8bit,adafactor]

Same model, batch (16 sequences x 1024 tokens, 768 completion tokens each), loss (grpo.yaml defaults), gradient
checkpointing and bf16 weights for every optimizer; each optimizer in a fresh subprocess so peaks are its own.
The first step (optimizer state allocation) is reported apart from the steady steps. Peak allocated memory is
reported per phase (before the step: weights and optimizer state; forward; backward; optimizer step), the maximum over steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one(preset: str, optimizer: str, steps: int, batch: int, seq: int, chunk: int = 512, fused: bool = True) -> dict:
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT / "src"))
    from grpo.models.loading import load_model
    from grpo.models.tiny import build_model_dir
    from grpo.trainer.logprobs import fused_token_loss, token_logprobs
    from grpo.trainer.loss_interface import LossInputs
    from grpo.trainer.optim import build_optimizer

    model = load_model(str(build_model_dir(preset, dtype="bfloat16")), torch.bfloat16, torch.device("cuda"), True)
    opt_cfg = OmegaConf.load(ROOT / f"conf/optimizer/{optimizer}.yaml")
    opt_cfg.pop("defaults")
    opt_cfg.lr = 1e-6
    loss_cfg = OmegaConf.load(ROOT / "conf/loss/grpo.yaml")
    loss_cfg.pop("defaults")
    loss_fn = instantiate(loss_cfg)
    opt = build_optimizer(model, opt_cfg)
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    labels = ids[:, 1:].clone()
    labels[:, : seq // 4] = -100  # the prompt quarter is not trained
    mask = (labels != -100).float()
    adv = torch.randn(batch, device="cuda", generator=g)
    temps = torch.ones(batch, device="cuda")
    model.train()  # from_pretrained returns eval mode, where transformers skips gradient checkpointing
    base_gb = torch.cuda.memory_allocated() / 1024**3
    times, phases = [], {}

    def mark(name):  # peak of the phase that just ended, then a fresh high-water mark for the next one
        torch.cuda.synchronize()
        phases[name] = max(phases.get(name, 0.0), torch.cuda.max_memory_allocated() / 1024**3)
        torch.cuda.reset_peak_memory_stats()

    with torch.no_grad():  # rollout log-probs close to the policy's (what vLLM sends with the rollouts); untimed
        old = (token_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), labels, temps, chunk_size=chunk)
               + 0.01 * torch.randn_like(mask)) * mask

    def loss_of(lp, with_metrics=True):
        return loss_fn(LossInputs(lp, old, adv, mask), with_metrics=with_metrics)

    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mark("before_step")  # weights + optimizer state carried from the previous step
        if fused:
            loss, _, _ = fused_token_loss(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), labels, temps, loss_of, chunk)
        else:
            loss, _ = loss_of(token_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), labels, temps, chunk_size=chunk))
        mark("forward")
        loss.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer_step")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = float(mask.sum())
    steady = times[1:] or times
    return {
        "optimizer": optimizer,
        "optimizer_class": type(opt).__name__,
        "trained_tokens_per_step": tokens,
        "first_step_s": times[0],
        "steady_step_s": sum(steady) / len(steady),
        "trained_tokens_per_s": tokens / (sum(steady) / len(steady)),
        "peak_allocated_gb": max(phases.values()),
        "peak_by_phase_gb": phases,
        "allocated_before_first_step_gb": base_gb,
        "fused_loss": fused,
        "logprob_chunk": chunk,
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3b")
    p.add_argument("--optimizers", default="adamw,adamw_8bit,adafactor")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512, help="train.logprob_chunk")
    p.add_argument("--unfused", action="store_true", help="train.fused_loss=false")
    p.add_argument("--out", required=True)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.preset, args.one, args.steps, args.batch, args.seq, args.chunk, not args.unfused)))
        return
    results = []
    for name in args.optimizers.split(","):
        proc = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--one", name, "--steps",
                               str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--chunk", str(args.chunk),
                               *(["--unfused"] if args.unfused else []), "--out", "-"],
                              capture_output=True, text=True, timeout=300)
        try:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        except (IndexError, json.JSONDecodeError):
            results.append({"optimizer": name, "error": proc.stderr[-2000:]})
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "batch": args.batch, "seq": args.seq, "chunk": args.chunk,
                                          "fused_loss": not args.unfused, "results": results}, indent=2))


if __name__ == "__main__":
    main()

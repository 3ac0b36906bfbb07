"""Peak memory and time of our log-prob + loss paths against the naive full-logits computation.

A 1-layer Qwen2 with Qwen2.5-0.5B's width and vocabulary (hidden 896, vocab 151,936, tied embeddings) on one
sequence of 2,048 tokens, forward + backward of the GRPO loss (``conf/loss/grpo.yaml``) on its log-probs. Variants:
``naive`` (full ``[T, vocab]`` float32 logits), ``chunked`` (``token_logprobs``: logits recomputed per chunk in
backward; ``train.fused_loss=false``) and ``fused`` (``fused_token_loss``: the loss gradient taken per chunk in the
forward, the trainer's default). ``--modes head`` times the output projection alone on random hidden states.
``--entropy on`` (the trainer's way since ``grpo/entropy``) has both paths also write each token's entropy
(``stats``); ``off`` leaves it out, so the two give its cost.
Each variant runs in its own subprocess so one's allocations can't
hide the other's. Peak memory is the high-water mark above the memory in use just before the measured step:
``torch.cuda.max_memory_allocated`` on CUDA, a 1 ms RSS sampler (``/proc/self/statm``) on CPU (torch's CPU
allocator returns big blocks to the OS, so RSS tracks live tensors). Time is the median of ``--repeats`` runs after
one warm-up.

    python bench/logprobs_bench.py                 # CPU here; --device cuda on a GPU machine
    python bench/logprobs_bench.py --quick         # smaller sizes, a smoke test

Prints a table and writes ``bench/results/logprobs_<device>_<dtype>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssPeak:
    """Samples RSS every millisecond in a thread; ``peak`` is the highest value seen."""

    def __enter__(self):
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_bytes())


def _worker(args) -> dict:
    """One variant in this process: build the model, measure one step's peak memory, then time it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(HERE.parent / "src"))
    from grpo.trainer.logprobs import (
        fused_hidden_loss,
        fused_token_loss,
        hidden_logprobs,
        naive_token_logprobs,
        token_logprobs,
    )

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=1,
        num_attention_heads=args.hidden // 64, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=args.seq_len,
    )
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    T = args.seq_len
    ids = torch.randint(0, args.vocab, (1, T), device=device)
    attn = torch.ones_like(ids)
    labels = torch.roll(ids, -1, 1)
    labels[:, : int(T * args.prompt_frac)] = -100  # prompt positions carry no loss
    labels[:, -1] = -100
    temps = torch.full((1,), 0.9, device=device)

    # The GRPO loss of conf/loss/grpo.yaml on rollout log-probs near the policy's (ratios on both sides of the clip).
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.loss_interface import LossInputs

    loss_fn = GRPOLoss()
    mask = (labels != -100).float()
    gen = torch.Generator(device="cpu").manual_seed(1)
    rollout = (torch.randn(labels.shape, generator=gen) * 0.1 - 8.0).to(device)
    adv = torch.randn(labels.shape[0], generator=gen).to(device)

    def loss_of(lp, with_metrics=True):
        return loss_fn(LossInputs(lp, rollout, adv, mask), with_metrics=with_metrics)

    def stats():  # a fresh dict per step asks for the tokens' entropies; None leaves them out
        return {} if args.entropy == "on" else None

    if args.mode == "head":
        # Only the output projection: random final hidden states into a trainable Linear(hidden, vocab).
        del model
        model = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(device=device, dtype=dtype)
        hidden = torch.randn(1, T, args.hidden, device=device, dtype=dtype, requires_grad=True)

        def step():
            if args.variant == "fused":
                loss = fused_hidden_loss(hidden, model, labels, temps, loss_of, chunk_size=args.chunk, stats=stats())[0]
            elif args.variant == "chunked":
                lp = hidden_logprobs(hidden, model, labels, temps, chunk_size=args.chunk, fused=True, stats=stats())
                loss = loss_of(lp)[0]
            else:
                logits = model(hidden).float() / temps[:, None, None]
                lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
                loss = loss_of(torch.where(labels != -100, lp, torch.zeros_like(lp)))[0]
            loss.backward()
    else:
        def step():
            if args.variant == "fused":
                loss = fused_token_loss(model, ids, attn, labels, temps, loss_of, chunk_size=args.chunk, stats=stats())[0]
            elif args.variant == "chunked":
                loss = loss_of(token_logprobs(model, ids, attn, labels, temps, chunk_size=args.chunk, stats=stats()))[0]
            else:
                loss = loss_of(naive_token_logprobs(model, ids, attn, labels, temps))[0]
            loss.backward()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Parameter gradients exist before measuring, so both variants start from the same resident set.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_bytes()
        with _RssPeak() as m:
            step()
        peak = m.peak - base
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"variant": args.variant, "peak_bytes": int(peak), "seconds": statistics.median(times), "times": times}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", default="float32", help="model dtype (bfloat16 on GPUs is the realistic choice)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompt-frac", type=float, nargs="+", default=[0.0, 0.25],
                   help="share of positions that are prompt (no loss); one row per value")
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 1024], help="chunk sizes of token_logprobs")
    p.add_argument("--variants", nargs="+", default=["fused", "chunked"], choices=["fused", "chunked"],
                   help="fused: loss gradient per chunk in the forward (train.fused_loss=true, the default); "
                        "chunked: log-probs with logits recomputed in backward (train.fused_loss=false)")
    p.add_argument("--chunk", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", default=["head", "model"], choices=["head", "model"],
                   help="head: lm_head Linear on random hidden states; model: 1-layer Qwen2 through token_logprobs")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--entropy", default="on", choices=["on", "off"],
                   help="on: the chunked paths also write each token's entropy (the trainer's way); off: they do not")
    p.add_argument("--quick", action="store_true", help="vocab 32k, 512 tokens, 1 repeat")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.seq_len, args.repeats = 32_000, 512, 1
    if args.variant:  # child process
        args.prompt_frac = args.prompt_frac[0]
        print(json.dumps(_worker(args)))
        return

    rows = []
    for mode, frac in [(m, f) for m in args.modes for f in args.prompt_frac]:
        def child(variant, chunk, mode=mode, frac=frac):
            cmd = [sys.executable, __file__, "--variant", variant, "--mode", mode, "--device", args.device,
                   "--dtype", args.dtype, "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                   "--seq-len", str(args.seq_len), "--prompt-frac", str(frac), "--chunk", str(chunk),
                   "--repeats", str(args.repeats), "--entropy", args.entropy]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            return json.loads(out.strip().splitlines()[-1])

        n = child("naive", 0)
        for chunk, variant in [(c, v) for c in args.chunks for v in args.variants]:
            c = child(variant, chunk)
            rows.append({
                "mode": mode, "variant": variant, "prompt_frac": frac, "chunk": chunk,
                "loss_tokens": args.seq_len - int(args.seq_len * frac) - 1,
                "naive_peak_mib": n["peak_bytes"] / 2**20, "chunked_peak_mib": c["peak_bytes"] / 2**20,
                "memory_ratio": n["peak_bytes"] / max(c["peak_bytes"], 1),
                "naive_s": n["seconds"], "chunked_s": c["seconds"], "speedup": n["seconds"] / c["seconds"],
                "naive_times": n["times"], "chunked_times": c["times"],
            })

    print(f"\ntoken_logprobs vs naive: vocab {args.vocab}, seq {args.seq_len}, hidden {args.hidden}, {args.dtype}, "
          f"{args.device}, forward+backward, median of {args.repeats}")
    print(f"{'mode':>6} {'variant':>8} {'prompt':>7} {'chunk':>6} {'loss tok':>8} {'naive MiB':>10} {'chunked MiB':>12} {'mem x':>6} "
          f"{'naive s':>8} {'chunked s':>10} {'speed x':>8}")
    for r in rows:
        print(f"{r['mode']:>6} {r['variant']:>8} {r['prompt_frac']:>7.2f} {r['chunk']:>6} {r['loss_tokens']:>8} {r['naive_peak_mib']:>10.0f} "
              f"{r['chunked_peak_mib']:>12.0f} {r['memory_ratio']:>6.1f} {r['naive_s']:>8.3f} "
              f"{r['chunked_s']:>10.3f} {r['speedup']:>8.2f}")
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("variant", "mode", "out", "chunk")},
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": __import__("torch").__version__, "gpu": _gpu_name()},
        "rows": rows,
    }
    out = Path(args.out) if args.out else HERE / "results" / f"logprobs_{args.device}_{args.dtype}{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_name():
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()

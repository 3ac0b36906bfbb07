"""Prefix sharing (train.prefix_sharing) against the unshared layout: the trainer's update (forward + backward +
clip + AdamW step) on a batch shaped like experiment=arith_grpo, and on a longer-prompt shape.

    python bench/prefix_sharing.py [--rounds 8] [--threads 1 2] [--out bench/results/prefix_sharing.json]

The real GRPOTrainer (``update``: the default fused loss, micro-batches of 64 rows, two per step) on the warm-start
model of experiment=arith_grpo (``warm-arith``, built and cached by ``python -m grpo.recipes.warmstart``). Shapes
(groups of 8 completions):

- arith: 16 prompts of 5-7 tokens, completions of 2-5 tokens (mean 3.5): ~1190 tokens a step, as the skill task.
- long: 16 prompts of 64 tokens, completions of 12-20 tokens (mean 16).

Shared and unshared updates alternate in one process (after a warm-up of each), so both see the same load; the
figures are medians of ``time/forward_backward_seconds`` and ``time/step_seconds``. The first update's loss of both
layouts is reported as the exactness check (the learning rate is 0, so every round trains the same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine  # noqa: E402

SHAPES = {  # name: (prompts, group size, prompt lengths (lo, hi), completion lengths (lo, hi))
    "arith": (16, 8, (5, 7), (2, 5)),
    "long": (16, 8, (64, 64), (12, 20)),
}


def groups_of(shape: str, seed: int = 0) -> list:
    import torch

    from grpo.pipeline.group import Group

    n, k, (plo, phi), (clo, chi) = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, 250, (int(torch.randint(plo, phi + 1, (1,), generator=g)),), generator=g).tolist()
        comps = [torch.randint(3, 250, (int(torch.randint(clo, chi + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(k)]
        lps = [[-1.0] * len(c) for c in comps]
        scores = torch.rand(k, generator=g).tolist()
        out.append(Group.sampled(prompt, comps, lps, scores, 1.0))
    return out


def trainer_of(model, shared: bool):
    import torch
    from omegaconf import OmegaConf

    from grpo.schema import TrainConfig
    from grpo.trainer.loop import GRPOTrainer
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.metrics import NullMetrics

    cfg = OmegaConf.structured(TrainConfig(steps=10**6, micro_batch_size=64, grad_accum=2, prefix_sharing=shared))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sync = SimpleNamespace(version=0, prepare_step=lambda step: None, before_optimizer_step=lambda: None,
                           after_optimizer_step=lambda: None)
    return GRPOTrainer(train_cfg=cfg, model=model, tokenizer=None, optimizer=opt, scheduler=sched,
                       loss_fn=GRPOLoss(), pipeline=None, sync=sync, checkpoints=None, metrics=NullMetrics(),
                       device=torch.device("cpu"))


def measure(shape: str, threads: int, rounds: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.pipeline.batching import prepare_batch
    from grpo.recipes.warmstart import build_warmstart_dir

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(build_warmstart_dir("warm-arith", progress=False), dtype=torch.float32)
    batch = prepare_batch(groups_of(shape), max_seq_len=4096, micro_batch_size=64, pad_token_id=256)
    trainers = {s: trainer_of(model, s) for s in (False, True)}
    rows: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(rounds + 1):  # round 0 warms both up and is dropped
        for shared in ((False, True) if r % 2 == 0 else (True, False)):
            row = trainers[shared].update(batch)
            if r:
                rows[shared].append(row)
    first = {s: rows[s][0] for s in rows}

    def med(s: bool, key: str) -> float:
        return statistics.median(x[key] for x in rows[s])

    out = {"shape": shape, "threads": threads, "rounds": rounds, "load_1min_before": os.getloadavg()[0],
           "tokens/total": batch.metrics["tokens/total"], "tokens/trained": batch.metrics["tokens/trained"],
           "loss_unshared": first[False]["loss"], "loss_shared": first[True]["loss"],
           "loss_abs_diff": abs(first[False]["loss"] - first[True]["loss"])}
    for s, name in ((False, "unshared"), (True, "shared")):
        out[f"{name}_forwarded_tokens"] = first[s]["tokens/forwarded"]
        out[f"{name}_pad_fraction"] = first[s]["batch/pad_fraction"]
        out[f"{name}_forward_backward_s"] = med(s, "time/forward_backward_seconds")
        out[f"{name}_step_s"] = med(s, "time/step_seconds")
    out["speedup_forward_backward"] = out["unshared_forward_backward_s"] / out["shared_forward_backward_s"]
    out["speedup_step"] = out["unshared_step_s"] / out["shared_step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", default=str(RESULTS / "prefix_sharing.json"))
    args = parser.parse_args()
    results = []
    for shape in args.shapes:
        for threads in args.threads:
            res = measure(shape, threads, args.rounds)
            print(json.dumps(res), flush=True)
            results.append(res)
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
            "machine": machine(), "results": results}
    Path(args.out).write_text(json.dumps(info, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()

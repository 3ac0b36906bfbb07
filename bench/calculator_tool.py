"""data=calculator on the CPU: held-out accuracy of a tiny model taught the calculator's format, before and after GRPO,
with the tool and without it (docs/multi_turn.md; the figures: bench/README.md, "Multi-turn: the calculator tool").

    python bench/calculator_tool.py [--steps 30] [--seed 0] [--sft-steps 800] [--out bench/results/calculator_tool.json]

1. Warm start (cached under $GRPO_CACHE/models/calc-tool-s<seed>-<sft steps>): tiny-qwen2 is trained by supervised
   learning on whole episodes of data=calculator's training split, its loss on the model turns only. The teacher
   calls the calculator (``calc: a*b``, then copies the tool's value as the answer) in half of the episodes, and in the
   other half answers at once with a wrong number of the right length: the model learns both habits, and GRPO has a
   right and a wrong one to tell apart.
2. GRPO (`python train.py '~experiment' data=calculator model.name=<warm dir>`), `--steps` steps, held-out greedy
   accuracy (whole episodes) at step 0 and every 10 steps; once with the tool, once with `data.task.tool=false` (the
   prompt does not offer it, every first turn is the answer).

Prints and writes one JSON object: each run's eval/accuracy curve, its seconds, the seeds and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import ROOT, machine  # noqa: E402

IGNORE = -100


def teacher_episode(task, renderer, tokenizer, prompt, rng: random.Random, direct_share: float):
    """(token ids, labels) of one teacher episode: a calculator call and the copied value, or a wrong direct answer."""
    from grpo.pipeline.calculator import evaluate

    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(prompt.text, add_special_tokens=False)
    labels = [IGNORE] * len(ids)

    def model_turn(text: str) -> None:
        turn = tokenizer.encode(text, add_special_tokens=False) + [eos]
        ids.extend(turn)
        labels.extend(turn)

    if rng.random() < direct_share:
        wrong = str(int(prompt.answer) + rng.choice([-1, 1]) * rng.randint(1, 10 ** (len(prompt.answer) - 1)))
        model_turn(wrong)
        return ids, labels
    expression = prompt.text.split("user\n", 1)[1].split("=", 1)[0]
    model_turn(f"calc: {expression}")
    tool = renderer.tokens(task.tool_role, str(evaluate(expression)))
    ids.extend(tool)
    labels.extend([IGNORE] * len(tool))
    model_turn(prompt.answer)
    return ids, labels


def warm_start(seed: int, steps: int, direct_share: float, init: Path | None = None, lr: float = 3e-3) -> Path:
    """The warm-started model directory (built once, cached); `init` continues from an earlier warm start."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.models.tiny import build_model_dir, cache_root
    from grpo.pipeline.calculator import LongArithmeticTask
    from grpo.pipeline.environment import TurnRenderer

    out = cache_root() / f"{init.name + '+' if init else 'calc-tool-'}s{seed}-{steps}-{direct_share}"
    if (out / "config.json").exists():
        return out
    torch.set_num_threads(1)  # on the shared 2-core machine one thread ran the SFT step 2.8x faster than two
    base = init or build_model_dir("tiny-qwen2", seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    task = LongArithmeticTask()  # conf/data/calculator.yaml's defaults
    task.bind_tokenizer(tokenizer)
    renderer = TurnRenderer(tokenizer)
    torch.manual_seed(seed)
    rng = random.Random(f"calc-tool-sft:{seed}:{init.name if init else ''}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * max(0.05, 1 - s / steps))
    model.train()
    t0 = time.monotonic()
    for step in range(steps):
        pairs = [teacher_episode(task, renderer, tokenizer, p, rng, direct_share) for p in task.sample(rng, 32)]
        width = max(len(i) for i, _ in pairs)
        ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in pairs])
        labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in pairs])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"sft step {step}: loss {loss.item():.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id,
                                                            "pad_token_id": tokenizer.pad_token_id}))
    tmp.rename(out)
    return out


def grpo_run(model_dir: Path, steps: int, seed: int, tool: bool, runs: Path) -> dict:
    """One train.py run; its eval/accuracy curve and seconds."""
    run_dir = runs / f"{'tool' if tool else 'no_tool'}-s{seed}"
    cmd = [sys.executable, str(ROOT / "train.py"), "~experiment", "data=calculator", f"model.name={model_dir}",
           "model.offline=null", f"train.steps={steps}", f"train.seed={seed}", "train.micro_batch_size=32",
           "train.grad_accum=2", "optimizer.lr=3e-4", "eval.every=10", "eval.samples_per_prompt=4", "eval.k=4",
           f"data.task.tool={str(tool).lower()}", f"hydra.run.dir={run_dir}", "logging.plot=false"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    seconds = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {int(r["step"]): r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None}
    turns = [r["episode/turns_mean"] for r in rows if r.get("episode/turns_mean") is not None]
    return {"tool": tool, "seed": seed, "eval_accuracy": curve, "turns_mean_first_last": [turns[0], turns[-1]],
            "seconds": round(seconds, 1), "run_dir": str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=800)
    parser.add_argument("--direct-share", type=float, default=0.5)
    parser.add_argument("--sft-more", type=int, default=0, help="then this many more SFT steps at half the lr")
    parser.add_argument("--runs", default="/tmp/calculator_tool_runs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "calculator_tool.json"))
    args = parser.parse_args()
    t0 = time.monotonic()
    model_dir = warm_start(args.seed, args.sft_steps, args.direct_share)
    if args.sft_more:
        model_dir = warm_start(args.seed, args.sft_more, args.direct_share, init=model_dir, lr=1.5e-3)
    sft_s = time.monotonic() - t0
    runs = [grpo_run(model_dir, args.steps, args.seed, tool, Path(args.runs)) for tool in (True, False)]
    result = {"bench": "calculator_tool", "sft_steps": [args.sft_steps, args.sft_more], "direct_share": args.direct_share,
              "warm_start_seconds": round(sft_s, 1), "grpo_steps": args.steps, "runs": runs, "machine": machine()}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""data=calculator on the CPU: held-out accuracy of a tiny model taught the calculator's format, before and after GRPO,
with the tool and without it (docs/multi_turn.md; the figures: bench/README.md, "Multi-turn: the calculator tool").

    python bench/calculator_tool.py [--seeds 0 1] [--warm-seed 0] [--steps 20] [--out bench/results/calculator_tool.json]

1. Warm start (cached under $GRPO_CACHE/models/calc-tool-v3-s<warm seed>-<settings>): tiny-qwen2 is trained by
   supervised learning on whole teacher episodes of data=calculator's training split (3-digit x 3-digit products),
   its loss on the model turns only. A `--plain-share` of the episodes have the prompt without the tool, answered at
   once with the right product; the others offer the tool, and the teacher calls it (``calc: a*b``, then copies the
   tool's value as the answer) in `--call-share` of them, else answers the product at once. Phase 1 (`--sft-steps`,
   call share 0.8) teaches the model to copy a call and the tool's value exactly; phase 2 (`--sft-more`, call share
   `--more-call-share` 0.25) makes calling rare, so the warm start mostly guesses the product: held-out accuracy low
   with the tool, and GRPO has a right habit (calling) and a wrong one (guessing) to tell apart.
   `first_turns` checks the warm start before any GRPO run (greedy and sampled first turns on the held-out items).
2. GRPO (`python train.py experiment=calculator_tiny model.name=<warm dir>`), `--steps` steps, held-out greedy
   accuracy (whole episodes) at step 0 and every `--eval-every` steps; for each of `--seeds` once with the tool and
   once with `data.task.tool=false` (the prompt does not offer it, every first turn is the answer): the same model,
   steps and seeds.

Prints and writes one JSON object: the warm start's settings, seconds and first turns, each run's eval/accuracy
(greedy) and eval/mean@k (sampled) curves, its reward per step and seconds, and the machine.
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


def teacher_episode(task, plain_task, renderer, tokenizer, prompt, rng: random.Random, call_share: float,
                    plain: bool):
    """(token ids, labels) of one teacher episode, its loss on the model turns only.

    `plain`: the prompt without the tool (`plain_task`), answered at once with the right product. Else the prompt that
    offers the tool: a calculator call and the copied value (`call_share` of the episodes), or the product at once.
    The direct answers are right, so the model learns to try the product itself: without the tool that is all it has,
    and with it GRPO weighs calling against guessing.
    """
    from grpo.tasks.calculator import evaluate
    from grpo.tasks.prompts import Prompt

    eos = tokenizer.eos_token_id
    expression = prompt.text.split("user\n", 1)[1].split("=", 1)[0]
    if plain:
        prompt = Prompt(plain_task.render(expression), prompt.answer)
    ids = tokenizer.encode(prompt.text, add_special_tokens=False)
    labels = [IGNORE] * len(ids)

    def model_turn(text: str) -> None:
        turn = tokenizer.encode(text, add_special_tokens=False) + [eos]
        ids.extend(turn)
        labels.extend(turn)

    if plain or rng.random() >= call_share:
        model_turn(prompt.answer)
        return ids, labels
    model_turn(f"calc: {expression}")
    tool = renderer.tokens(task.tool_role, str(evaluate(expression)))
    ids.extend(tool)
    labels.extend([IGNORE] * len(tool))
    model_turn(prompt.answer)
    return ids, labels


def warm_start(seed: int, steps: int, call_share: float, plain_share: float, lr: float, task_args: dict,
               init: Path | None = None) -> Path:
    """The warm-started model directory (built once, cached under a name that holds every setting); `init` continues
    from an earlier warm start (a fresh optimizer and warm-up, another data stream)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.models.tiny import build_model_dir, cache_root
    from grpo.tasks.calculator import LongArithmeticTask
    from grpo.tasks.environment import TurnRenderer

    digits = f"{task_args['min_digits']}-{task_args['max_digits']}"
    name = f"s{seed}-{steps}-{call_share}-{plain_share}-{lr}-d{digits}"
    out = cache_root() / (f"{init.name}+{name}" if init else f"calc-tool-v3-{name}")
    if (out / "config.json").exists():
        return out
    torch.set_num_threads(1)  # on the shared 2-core machine one thread ran the SFT step 2.8x faster than two
    base = init or build_model_dir("tiny-qwen2", seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    task, plain_task = LongArithmeticTask(**task_args), LongArithmeticTask(**task_args, tool=False)
    for t in (task, plain_task):
        t.bind_tokenizer(tokenizer)
    renderer = TurnRenderer(tokenizer)
    torch.manual_seed(seed)
    rng = random.Random(f"calc-tool-sft:{seed}:{init.name if init else ''}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)  # warm-arith's
    # Linear warm-up, then constant: an annealed model sits in a sharp minimum that the first RL updates knock it
    # out of (src/grpo/recipes/warmstart.py, warm-arith).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    model.train()
    t0 = time.monotonic()
    for step in range(steps):
        pairs = [teacher_episode(task, plain_task, renderer, tokenizer, p, rng, call_share, rng.random() < plain_share)
                 for p in task.sample(rng, 32)]
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
        if (step + 1) % 250 == 0 and step + 1 < steps:
            model.eval()
            print(f"  step {step + 1}: {json.dumps(first_turns(model, tokenizer, task))}", flush=True)
            model.train()
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id,
                                                            "pad_token_id": tokenizer.pad_token_id}))
    tmp.rename(out)
    return out


def first_turns(model, tokenizer, task, samples: int = 4) -> dict:
    """The warm start's first turns on the held-out items (tool offered), in transformers: the share that call the
    calculator and the share that copy the item exactly (`calc: <expression>`), greedy and at temperature 1."""
    import torch

    from grpo.recipes.warmstart import generate_answers
    from grpo.tasks.environment import TurnRenderer

    heldout = task.eval_prompts()
    out = {}
    for name, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
        torch.manual_seed(0)
        turns = generate_answers(model, tokenizer, [p.text for p in heldout], 24, temperature, n)
        expressions = [p.text.split("user\n", 1)[1].split("=", 1)[0] for p in heldout for _ in range(n)]
        out[f"{name}_call"] = round(sum(t.startswith("calc:") for t in turns) / len(turns), 3)
        out[f"{name}_exact_copy"] = round(sum(t == f"calc: {e}" for t, e in zip(turns, expressions)) / len(turns), 3)
        out[f"{name}_examples"] = [f"{e} -> {t}" for e, t in list(zip(expressions, turns))[:3]]
    # The second turn after an exact call: the share of greedy answers that copy the tool's value.
    renderer = TurnRenderer(tokenizer)
    texts = [p.text + f"calc: {e}{tokenizer.eos_token}" + renderer.text(task.tool_role, p.answer)
             for p, e in zip(heldout, (p.text.split("user\n", 1)[1].split("=", 1)[0] for p in heldout))]
    answers = generate_answers(model, tokenizer, texts, 24)
    out["greedy_answer_copy"] = round(sum(a == p.answer for a, p in zip(answers, heldout)) / len(heldout), 3)
    return out


def grpo_run(model_dir: Path, args: argparse.Namespace, seed: int, tool: bool) -> dict:
    """One train.py run; its eval/accuracy curve and seconds."""
    run_dir = Path(args.runs) / f"{'tool' if tool else 'no_tool'}-s{seed}"
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=calculator_tiny", f"model.name={model_dir}",
           "model.offline=null", f"train.steps={args.steps}", f"train.seed={seed}", f"optimizer.lr={args.lr}",
           f"eval.every={args.eval_every}", f"data.task.min_digits={args.min_digits}",
           f"data.task.max_digits={args.max_digits}", f"data.task.tool={str(tool).lower()}",
           f"hydra.run.dir={run_dir}", "logging.plot=false"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    seconds = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {int(r["step"]): r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None}
    sampled = {int(r["step"]): round(r["eval/mean@k"], 3) for r in rows if r.get("eval/mean@k") is not None}
    turns = [r["episode/turns_mean"] for r in rows if r.get("episode/turns_mean") is not None]
    rewards = [round(r["reward/mean"], 3) for r in rows if r.get("reward/mean") is not None]
    return {"tool": tool, "seed": seed, "eval_accuracy": curve, "eval_sampled_accuracy": sampled,
            "turns_mean_first_last": [turns[0], turns[-1]],
            "reward_mean_per_step": rewards, "seconds": round(seconds, 1), "run_dir": str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-4, help="GRPO learning rate")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="GRPO seeds (train.seed), each run twice")
    parser.add_argument("--warm-seed", type=int, default=0, help="seed of the warm start (one model for all runs)")
    parser.add_argument("--sft-steps", type=int, default=1500)
    parser.add_argument("--sft-lr", type=float, default=5e-4)
    parser.add_argument("--sft-more", type=int, default=300,
                        help="then continue for this many steps with --more-call-share (a fresh optimizer)")
    parser.add_argument("--more-call-share", type=float, default=0.25)
    parser.add_argument("--call-share", type=float, default=0.8, help="teacher episodes with the tool that call it")
    parser.add_argument("--plain-share", type=float, default=0.2, help="teacher episodes without the tool offered")
    parser.add_argument("--min-digits", type=int, default=3)
    parser.add_argument("--max-digits", type=int, default=3)
    parser.add_argument("--warm-only", action="store_true",
                        help="build the warm start, print its directory and first turns, stop")
    parser.add_argument("--runs", default="/tmp/calculator_tool_runs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "calculator_tool.json"))
    args = parser.parse_args()
    t0 = time.monotonic()
    task_args = {"min_digits": args.min_digits, "max_digits": args.max_digits}
    model_dir = warm_start(args.warm_seed, args.sft_steps, args.call_share, args.plain_share, args.sft_lr, task_args)
    if args.sft_more:
        model_dir = warm_start(args.warm_seed, args.sft_more, args.more_call_share, args.plain_share, args.sft_lr,
                               task_args, init=model_dir)
    sft_s = time.monotonic() - t0
    warm = warm_start_quality(model_dir, task_args)
    print(json.dumps({"warm_start": str(model_dir), **warm}), flush=True)
    if args.warm_only:
        return
    runs = [grpo_run(model_dir, args, seed, tool) for seed in args.seeds for tool in (True, False)]
    result = {"bench": "calculator_tool", "warm_start": {"dir": str(model_dir), "seed": args.warm_seed,
                                                         "sft_steps": [args.sft_steps, args.sft_more], "sft_lr": args.sft_lr,
                                                         "call_share": [args.call_share, args.more_call_share],
                                                         "plain_share": args.plain_share,
                                                         "seconds": round(sft_s, 1), "first_turns": warm},
              "task": task_args, "grpo_steps": args.steps, "grpo_lr": args.lr, "runs": runs, "machine": machine()}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def warm_start_quality(model_dir: Path, task_args: dict) -> dict:
    """`first_turns` of the built warm start."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.tasks.calculator import LongArithmeticTask

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    task = LongArithmeticTask(**task_args)
    task.bind_tokenizer(tokenizer)
    return first_turns(model, tokenizer, task)


if __name__ == "__main__":
    main()

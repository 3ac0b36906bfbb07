"""Baseline of SmolLM2-135M-Instruct on candidate chat-arithmetic tasks: held-out greedy accuracy and pass@k, graded by
math-verify, with vLLM's own in-process engine (CPU or GPU). Used to choose the real-model task (issue 37): a task
the model has part of (greedy accuracy between 10 % and 50 %) with reward variance inside groups.

    python bench/real_model_baseline.py --items 500 --k 8 --out bench/results/real_model_baseline_cpu.json
    python bench/real_model_baseline.py --variants sum2_number --items 100   # one variant, fewer items

Each variant is a ChatArithmeticTask setting (digits, operators, question, system prompt) and a token budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

ONLY_NUMBER = "Reply with the final number only."
VARIANTS = {
    # two 2-digit operands, + only, the template's default system prompt, free-form answer
    "sum2_default": dict(task=dict(max_digits=2, min_digits=2, operators="+"), question="What is {expression}?",
                         system_prompt=None, max_tokens=128),
    # two 2-digit operands, + only, asked for the number only
    "sum2_number": dict(task=dict(max_digits=2, min_digits=2, operators="+"), question="What is {expression}? " + ONLY_NUMBER,
                        system_prompt="You are a helpful assistant.", max_tokens=32),
    # + and -, two 2-digit operands, number only
    "pm2_number": dict(task=dict(max_digits=2, min_digits=2, operators="+-"), question="What is {expression}? " + ONLY_NUMBER,
                       system_prompt="You are a helpful assistant.", max_tokens=32),
    # one- and two-digit operands, + and -, number only
    "pm12_number": dict(task=dict(max_digits=2, min_digits=1, operators="+-"), question="What is {expression}? " + ONLY_NUMBER,
                        system_prompt="You are a helpful assistant.", max_tokens=32),
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al.)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def evaluate(llm, tokenizer, name: str, spec: dict, items: int, k: int, seed: int) -> dict:
    from vllm import SamplingParams

    from grpo.tasks.chat_arithmetic import ChatArithmeticTask
    from grpo.tasks.rewards import BareNumberReward, MathVerifyReward

    task = ChatArithmeticTask(question=spec["question"], system_prompt=spec["system_prompt"], heldout_size=items,
                              **spec["task"])
    task.bind_tokenizer(tokenizer)
    prompts = task.eval_prompts()
    correct, bare = MathVerifyReward(literal_answer=True), BareNumberReward()
    t0 = time.perf_counter()
    greedy = llm.generate([p.text for p in prompts], SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"]))
    sampled = llm.generate([p.text for p in prompts], SamplingParams(temperature=1.0, n=k, max_tokens=spec["max_tokens"],
                                                                     seed=seed))
    seconds = time.perf_counter() - t0
    g = [correct(p, o.outputs[0].text) for p, o in zip(prompts, greedy)]
    per_item = [[correct(p, c.text) for c in o.outputs] for p, o in zip(prompts, sampled)]
    tokens = sum(len(c.token_ids) for o in (*greedy, *sampled) for c in o.outputs)
    cut = sum(c.finish_reason == "length" for o in sampled for c in o.outputs) / (len(prompts) * k)
    mixed = sum(0 < sum(r) < k for r in per_item) / len(prompts)
    return {
        "variant": name, **{kk: v for kk, v in spec.items() if kk != "task"}, "task": spec["task"], "items": len(prompts),
        "greedy_accuracy": sum(g) / len(g), "sampled_accuracy": sum(map(sum, per_item)) / (len(prompts) * k),
        f"pass@{k}": sum(pass_at_k(k, int(sum(r)), k) for r in per_item) / len(prompts),
        "groups_with_reward_variance": mixed, "sampled_cut_at_max_tokens": cut,
        "greedy_bare_number": sum(bare(p, o.outputs[0].text) for p, o in zip(prompts, greedy)) / len(prompts),
        "generated_tokens": tokens, "seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 1),
        "examples": [{"prompt_tail": p.text[-60:], "greedy": o.outputs[0].text[:200], "answer": p.answer}
                     for p, o in list(zip(prompts, greedy))[:4]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (a faster engine start)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from vllm import LLM

    from grpo.models.packaged import build_packaged_model_dir

    model_dir = str(build_packaged_model_dir("smollm2-135m"))
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype=args.dtype, max_model_len=1024, seed=args.seed, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=0.3 if _cuda() else 0.2)
    startup = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    rows = []
    for name in args.variants.split(","):
        rows.append(evaluate(llm, tokenizer, name, VARIANTS[name], args.items, args.k, args.seed))
        r = rows[-1]
        print(f"{name}: greedy {r['greedy_accuracy']:.3f} sampled {r['sampled_accuracy']:.3f} pass@{args.k} "
              f"{r[f'pass@{args.k}']:.3f} mixed groups {r['groups_with_reward_variance']:.2f} cut "
              f"{r['sampled_cut_at_max_tokens']:.2f} bare {r['greedy_bare_number']:.2f} {r['tokens_per_second']} tok/s",
              flush=True)
    result = {"date": str(date.today()), "host": platform.node(), "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg(), "dtype": args.dtype, "engine_startup_seconds": round(startup, 1),
              "command": "python bench/real_model_baseline.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()

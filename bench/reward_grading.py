"""Grading one rollout batch of the real-model task (data=chat_arith's rewards: math-verify and the bare number) the
way main graded it (each completion in turn, in the trainer's process), in this process with deduplication
(`data.reward_workers=0`) and in worker processes (`data.reward_workers=2`), alternated round by round.

    python bench/reward_grading.py --out bench/results/reward_grading.json

Batches of 32 prompts x 8 completions shaped as SmolLM2-135M-Instruct writes them (~14 tokens): "mixed", eight
different completions per group (the sum written out right or wrong, a bare number, prose, an echoed expression),
as early in training; "converged", the same right completion 8 times per group, as late in training. "eval" is the
evaluator's shape: 500 prompts x (1 greedy + 8 samples) of the mixed kind, graded with `parses` as it asks.

"beside a trainer thread": asynchronous rollouts grade on the producer thread while the trainer's thread trains. A
stand-in trainer thread (small torch ops one after another on one torch thread: Python-heavy, as the step of a
135M model is) runs a fixed amount of work alone, then while another thread grades mixed batches without pause, in
this process or through one worker process; its seconds say how much the grading's GIL costs it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))


def group_texts(a: int, b: int, rng: random.Random) -> list[str]:
    """Eight completions of "What is a + b?" as the small model writes them, right and wrong."""
    c, wrong = a + b, a + b + rng.choice([-10, -1, 1, 2, 10])
    return [f"{a} + {b} = {c}.", f"{c}", f"{a} + {b} = {wrong}.", f"{wrong}",
            f"The answer is {c}.", f"To find the sum, add {a} and {b}: the result is {wrong}.", f"{a} + {b}",
            f"Let me think. {a} plus {b} makes {c}, so the final number is {c}."]


def batch(kind: str, prompts: int, seed: int) -> list:
    from grpo.tasks.prompts import Prompt

    rng = random.Random(seed)
    pairs = []
    for _ in range(prompts):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        prompt = Prompt(f"What is {a} + {b}? Reply with the final number only.", str(a + b))
        texts = group_texts(a, b, rng)
        if kind == "converged":
            texts = [texts[0]] * 8
        elif kind == "eval":
            texts = [texts[rng.randrange(8)]] + texts  # a greedy completion, then 8 samples
        pairs += [(prompt, t) for t in texts]
    return pairs


def trainer_work(steps: int = 400) -> float:
    """Seconds of `steps` stand-in trainer steps: small torch ops whose Python overhead needs the GIL."""
    import torch

    x, w = torch.randn(32, 64), torch.randn(64, 64, requires_grad=True)
    t = time.perf_counter()
    for _ in range(steps):
        loss = torch.tanh(x @ w).sum()
        loss.backward()
        with torch.no_grad():
            w -= 1e-4 * w.grad
            w.grad = None
    return time.perf_counter() - t


def beside_trainer(rewards, specs, build, rounds: int) -> dict:
    """The stand-in trainer's seconds alone, beside in-process grading and beside grading in one worker process."""
    import threading

    import torch

    from grpo.pipeline.grading import Grader, picklable_specs

    torch.set_num_threads(1)
    here, pooled = Grader(rewards), Grader(rewards, picklable_specs(specs), build, 1)
    pooled.grade(batch("mixed", 4, 99))  # started
    out: dict[str, list[float]] = {"alone": [], "beside in-process grading": [], "beside 1 reward worker": []}
    try:
        for r in range(rounds):
            out["alone"].append(trainer_work())
            for name, grader in (("beside in-process grading", here), ("beside 1 reward worker", pooled)):
                stop = threading.Event()

                def grade(grader=grader, stop=stop, seed=r) -> None:
                    while not stop.is_set():
                        grader.grade(batch("mixed", 32, seed))

                thread = threading.Thread(target=grade)
                thread.start()
                time.sleep(0.05)
                out[name].append(trainer_work())
                stop.set()
                thread.join()
    finally:
        pooled.close()
    medians = {name: statistics.median(v) for name, v in out.items()}
    print("stand-in trainer, medians of %d: " % rounds + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items()),
          flush=True)
    return {"median_s": medians, "seconds": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--eval-rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reward_grading.json")
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from grpo.conf import CONFIG_DIR
    from grpo.pipeline.grading import Grader, picklable_specs
    from grpo.pipeline.local import build_rewards, weighted_reward

    specs = OmegaConf.load(CONFIG_DIR / "data" / "chat_arith.yaml").rewards
    rewards = build_rewards(specs)
    here = Grader(rewards)
    t0 = time.monotonic()
    pooled = Grader(rewards, picklable_specs(specs), build_rewards, args.workers)
    pooled.grade(batch("mixed", 4, 99))  # waits for the workers' start-up (spawn, imports, building the rewards)
    start_s = time.monotonic() - t0

    def one_by_one(pairs: list, parses: bool) -> None:  # main's way: every completion in turn, in this process
        for prompt, text in pairs:
            weighted_reward(rewards, prompt, text)
            if parses:
                [fn.parses(prompt, text) for fn, _ in rewards.values() if hasattr(fn, "parses")]

    ways = {"each completion in process (main)": lambda p, parses: one_by_one(p, parses),
            "deduplicated in process (reward_workers=0)": lambda p, parses: here.grade(p, parses),
            f"deduplicated, reward_workers={args.workers}": lambda p, parses: pooled.grade(p, parses)}
    results: dict = {"machine": machine(), "workers": args.workers, "pool_start_s": start_s, "batches": {}}
    try:
        for kind, prompts, rounds in (("mixed", 32, args.rounds), ("converged", 32, args.rounds),
                                      ("eval", 500, args.eval_rounds)):
            parses = kind == "eval"
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(rounds):
                pairs = batch(kind, prompts, seed=r)  # a fresh batch each round: math-verify caches nothing across
                for name, way in ways.items():
                    t = time.perf_counter()
                    way(pairs, parses)
                    seconds[name].append(time.perf_counter() - t)
            distinct = len(set(batch(kind, prompts, seed=0)))
            results["batches"][kind] = {
                "completions": len(pairs), "distinct": distinct,
                "median_s": {name: statistics.median(v) for name, v in seconds.items()}, "seconds": seconds}
            print(f"{kind}: {len(pairs)} completions ({distinct} distinct), medians of {rounds}: "
                  + ", ".join(f"{name} {statistics.median(v):.4f} s" for name, v in seconds.items()), flush=True)
    finally:
        pooled.close()
    results["beside_trainer"] = beside_trainer(rewards, specs, build_rewards, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"pool start-up {start_s:.2f} s; wrote {args.out}")


if __name__ == "__main__":
    main()

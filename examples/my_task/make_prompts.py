"""Writes the example's two prompt files (run once; the files are committed):

    python -m examples.my_task.make_prompts

The task: two-digit sums and differences (`47+85=` -> `132`), the skill the `warm_arith` model half knows. The
held-out file is the arithmetic task's held-out set, the items the warm-start model never saw in its supervised
warm-up, so held-out accuracy measures what the model learned, not what it memorised. Your own task brings
its own files; this script only shows where these came from.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from grpo.tasks.arithmetic import ArithmeticTask

HERE = Path(__file__).resolve().parent
TRAIN_ITEMS = 2000
EVAL_ITEMS = 500


def write_jsonl(path: Path, prompts) -> None:
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"question": p.text, "answer": p.answer}) + "\n")


def main() -> None:
    task = ArithmeticTask()  # conf/data/arithmetic.yaml's shape: two operands of two digits
    held_out = task.eval_prompts()[:EVAL_ITEMS]  # all of them
    train, seen = [], set()
    rng = random.Random(0)
    while len(train) < TRAIN_ITEMS:  # distinct items; `sample` never draws a held-out one
        p = task.sample(rng, 1)[0]
        if p.text not in seen:
            seen.add(p.text)
            train.append(p)
    write_jsonl(HERE / "prompts.jsonl", train)
    write_jsonl(HERE / "eval_prompts.jsonl", held_out)


if __name__ == "__main__":
    main()

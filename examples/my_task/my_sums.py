"""A task of your own making (docs/own_task.md): a `grpo.tasks.prompts.Task` subclass that draws its training prompts
in code instead of reading a file. `conf/data/sums.yaml` plugs it in:

    python train.py --config-dir examples/my_task/conf '~experiment' model=warm_arith data=sums \
        train.micro_batch_size=64 train.warmup_steps=10 optimizer.lr=1e-4
"""

from __future__ import annotations

import json
import random

from grpo.tasks.prompts import Prompt, Task


class SumsAndDifferences(Task):
    """`a+b=` or `a-b=` of two 2-digit numbers, answered with the integer; never draws a prompt of `eval_path`."""

    def __init__(self, eval_path: str) -> None:
        with open(eval_path) as f:
            self.held_out = [Prompt(row["question"], answer=row["answer"]) for row in map(json.loads, f)]
        self.held_out_texts = {p.text for p in self.held_out}

    @staticmethod
    def draw(rng: random.Random) -> Prompt:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        return Prompt(f"{a}{op}{b}=", answer=str(a + b if op == "+" else a - b))

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        """`n` prompts drawn from `rng` only (a resumed run draws the same ones), none of them held out."""
        out: list[Prompt] = []
        while len(out) < n:
            p = self.draw(rng)
            if p.text not in self.held_out_texts:
                out.append(p)
        return out

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts (for the run's evaluation; without this method, run with eval=off)."""
        return list(self.held_out)

    def can_sample(self, prompt: Prompt) -> bool:
        """Whether `sample` may draw `prompt`: the evaluation checks its prompts against it."""
        return prompt.text not in self.held_out_texts

"""A task of your own making (README "Your own task"): a `grpo.pipeline.tasks.Task` subclass that draws its prompts
in code instead of reading a file. `conf/data/repeat_words.yaml` plugs it in:

    python train.py --config-dir examples/my_task/conf '~experiment' data=repeat_words
"""

from __future__ import annotations

import random

from grpo.pipeline.tasks import Prompt, Task

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "plant", "chair", "bread", "grass", "house", "water")


class RepeatWords(Task):
    """'Repeat the word: <w>' with the word as the answer; the last `held_out` words are never drawn in training."""

    def __init__(self, held_out: int = 4) -> None:
        if not 0 < held_out < len(WORDS):
            raise ValueError(f"held_out must be between 1 and {len(WORDS) - 1}, got {held_out}")
        self.train_words, self.eval_words = WORDS[:-held_out], WORDS[-held_out:]

    @staticmethod
    def prompt(word: str) -> Prompt:
        return Prompt(f"Repeat the word: {word}\n", answer=word)

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        """`n` prompts drawn from `rng` only (a resumed run draws the same ones)."""
        return [self.prompt(rng.choice(self.train_words)) for _ in range(n)]

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts (for the run's evaluation; without this method, run with eval=off)."""
        return [self.prompt(w) for w in self.eval_words]

    def can_sample(self, prompt: Prompt) -> bool:
        """Whether `sample` may draw `prompt`: the evaluation checks its prompts against it."""
        return prompt.answer in self.train_words

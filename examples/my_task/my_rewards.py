"""Reward functions of the example task: plain functions `reward(prompt, completion) -> float`.

`prompt.text` is the rendered prompt, `prompt.answer` the value of the task's answer column (a string; None when
the task has no answer column), `completion` the decoded completion without special tokens.

Write a reward that only the behaviour you want can earn. A "shaped" reward that gives partial credit for looking
like the answer (e.g. the share of the answer's characters in the completion) is climbed by the cheapest behaviour
that earns it: a tiny model learns to print `eeeeeeee` for words full of e's. Here the main reward is the exact
answer and the small one only rewards the format, which a wrong answer earns too.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")


def exact_answer(prompt, completion: str) -> float:
    """1.0 when the completion is exactly the reference answer (whitespace around it allowed), else 0.0."""
    if prompt.answer is None:
        return 0.0
    return 1.0 if completion.strip() == prompt.answer else 0.0


def one_integer(prompt, completion: str) -> float:
    """1.0 when the completion is one integer and nothing else, right or wrong (keeps the format; weigh it low)."""
    return 1.0 if _INTEGER.fullmatch(completion.strip()) else 0.0

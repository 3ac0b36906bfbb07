"""Reward functions of the example task: plain functions `reward(prompt, completion) -> float`.

`prompt.text` is the rendered prompt, `prompt.answer` the value of the task's answer column (a string; None when
the task has no answer column), `completion` the decoded completion without special tokens.
"""

from __future__ import annotations


def answer_characters(prompt, completion: str) -> float:
    """Share of the completion's characters that occur in the reference answer (0..1; 0 when empty).

    A shaped reward a tiny random model can climb: it first learns to use the answer's characters at all.
    """
    if not completion or not prompt.answer:
        return 0.0
    allowed = set(prompt.answer)
    return sum(c in allowed for c in completion) / len(completion)


def exact_answer(prompt, completion: str) -> float:
    """1.0 when the completion, stripped, starts with the reference answer, else 0.0."""
    if not prompt.answer:
        return 0.0
    return 1.0 if completion.strip().startswith(prompt.answer) else 0.0

"""Reward functions of the built-in rollout pipeline (conf/data/local_*.yaml `rewards:`).

Each is a callable `reward(prompt, completion) -> float`; the pipeline sums them with the weights from the config.
"""

from __future__ import annotations

import math
import re

from grpo.pipeline.tasks import Prompt

# A number as people write it: optional sign, thousands commas, decimals ("-1,234.50", "$12", "7.").
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_HASH_ANSWER = re.compile(r"####\s*-?\$?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{\s*-?\$?\d[\d,]*(?:\.\d+)?\s*\}")


def parse_number(text: str) -> float | None:
    """`text` as a number after removing '$' and thousands commas; None when it is not one."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def last_number(text: str) -> float | None:
    """The last number written in `text`, or None."""
    matches = _NUMBER.findall(text)
    return parse_number(matches[-1]) if matches else None


class DigitFractionReward:
    """Share of the completion's characters that are ASCII digits (0..1; 0 for an empty completion)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if not completion:
            return 0.0
        return sum(c in "0123456789" for c in completion) / len(completion)


class MathAnswerReward:
    """1.0 when the last number in the completion equals the prompt's answer (numerically), else 0.0."""

    def __init__(self, tolerance: float = 1e-6) -> None:
        self.tolerance = tolerance

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if prompt.answer is None:
            return 0.0
        gold, got = parse_number(prompt.answer), last_number(completion)
        if gold is None or got is None:
            return 0.0
        return 1.0 if math.isclose(got, gold, rel_tol=self.tolerance, abs_tol=self.tolerance) else 0.0

    def parses(self, prompt: Prompt, completion: str) -> bool:  # noqa: ARG002
        """Whether the completion states any number this reward could grade (the evaluator counts those that don't)."""
        return last_number(completion) is not None


class AnswerFormatReward:
    """1.0 when the completion states a final numeric answer as '#### <number>' or '\\boxed{<number>}', else 0.0.

    Keep its weight small (conf/data/local_gsm8k.yaml uses 0.1): it shapes the format, correctness dominates.
    """

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if _HASH_ANSWER.search(completion) or _BOXED.search(completion) else 0.0

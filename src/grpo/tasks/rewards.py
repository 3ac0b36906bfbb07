"""Reward functions of the built-in rollout pipeline (conf/data/local_*.yaml `rewards:`).

Each is a callable `reward(prompt, completion) -> float`; the pipeline sums them with the weights from the config.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import threading
from typing import Any

from grpo.tasks.prompts import Prompt

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


def _math_verify_timeouts() -> int | None:
    """math-verify bounds parsing and comparison with SIGALRM, which only the main thread may set: rewards computed on
    a producer thread (asynchronous rollouts) run without that bound (their inputs are short model completions)."""
    return 5 if threading.current_thread() is threading.main_thread() else None


# An answer stated as a value: an integer or decimal, or a fraction of two integers (a/b, \frac{a}{b}, \frac ab).
_LITERAL = re.compile(r"-?(?:\d+(?:\.\d+)?|\d+/\d+|\\d?frac\{?\d+\}?\{?\d+\}?)")


def is_literal(text: str) -> bool:
    """Whether `text` (an answer as math-verify prints its parse, or a reference) is a value, not an expression."""
    return bool(_LITERAL.fullmatch(text.replace(" ", "").replace(",", "")))


class MathVerifyReward:
    """1.0 when Hugging Face's `math-verify` finds the completion's answer equal to the prompt's, else 0.0.

    It extracts the answer as the field's math environments do (a `\\boxed{}`, LaTeX or a plain expression, the last
    one written) and compares mathematically: `1/2`, `0.5` and `\\boxed{\\frac12}` are the same answer.
    """

    def __init__(self, literal_answer: bool | str = "auto") -> None:
        # The answer must be stated as a value ("-60", "1/2", "\\frac12"), not an expression that evaluates to it:
        # math-verify grades "13 - 73" right for "What is 13 - 73?", and a policy learns to echo the question. "auto"
        # (the default) requires it wherever the reference answer is a value; true always; false never.
        if literal_answer not in (True, False, "auto"):
            raise ValueError(f"MathVerifyReward.literal_answer must be true, false or 'auto', got {literal_answer!r}")
        self.literal_answer = literal_answer
        # Looked up now, imported at the first grading: the import (sympy: a second here, two on the lent GPU hosts)
        # is paid only by a process that grades. With data.reward_workers the trainer's process never does, and its
        # vLLM server is launched that much sooner.
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("MathVerifyReward needs the math-verify package: pip install math-verify==0.9.0")
        self._math_verify_module: Any = None
        self._gold: dict[str, list] = {}
        # The last completion parsed and its parse: the evaluator asks `parses` right after grading the same text,
        # and parsing is most of math-verify's time. One tuple, replaced whole, so threads never see a torn pair.
        self._last: tuple[str, list] | None = None

    @property
    def _math_verify(self) -> Any:
        if self._math_verify_module is None:
            self._math_verify_module = importlib.import_module("math_verify")
        return self._math_verify_module

    def _parse(self, text: str) -> list:
        return self._math_verify.parse(text, parsing_timeout=_math_verify_timeouts())

    def _parse_completion(self, text: str) -> list:
        last = self._last
        if last is not None and last[0] == text:
            return last[1]
        parsed = self._parse(text)
        self._last = (text, parsed)
        return parsed

    def _gold_of(self, answer: str) -> list:
        if answer not in self._gold:
            self._gold[answer] = self._parse(answer)
        return self._gold[answer]

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if prompt.answer is None:
            return 0.0
        got = self._parse_completion(completion)
        if not got or (self.requires_literal(prompt.answer) and not is_literal(str(got[-1]))):
            return 0.0
        same = self._math_verify.verify(self._gold_of(prompt.answer), got, timeout_seconds=_math_verify_timeouts())
        return 1.0 if same else 0.0

    def requires_literal(self, answer: str) -> bool:
        """Whether a completion must state the reference `answer` as a value to score (see literal_answer)."""
        return self.literal_answer is True or (self.literal_answer == "auto" and is_literal(answer))

    def parses(self, prompt: Prompt, completion: str) -> bool:  # noqa: ARG002
        """Whether math-verify extracts any answer from the completion (the evaluator counts those it doesn't)."""
        return bool(self._parse_completion(completion))


# A completion that is one number and nothing else ("132", " -7.", "1,024").
_BARE_NUMBER = re.compile(r"\s*-?\d[\d,]*(?:\.\d+)?\.?\s*")


class BareNumberReward:
    """1.0 when the completion is one number and nothing else (right or wrong), else 0.0: the format a question that
    says "reply with the number only" asks for. Keep its weight small; correctness dominates."""

    def __call__(self, prompt: Prompt, completion: str) -> float:  # noqa: ARG002
        return 1.0 if _BARE_NUMBER.fullmatch(completion) else 0.0

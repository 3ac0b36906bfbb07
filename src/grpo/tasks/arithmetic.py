"""The arithmetic skill task: integer + / - expressions, answered exactly.

Why this task: a tiny byte-level model learns part of it in a few minutes of supervised warm-up and GRPO can then
improve it within minutes on CPU, while the work per item varies (no carry, a carry into the hundreds, a borrow, a
sign change), so accuracy has room to rise. Every answer is one integer, so correctness is an exact comparison and
cannot be argued with. The shipped configuration (conf/data/arithmetic.yaml) is two 2-digit operands: 58 % of
those items need a carry or a borrow, the step a careless solver gets wrong (`careless_answer`).

Prompt: the expression followed by '=', e.g. ``"47+85="``; the model continues with the answer.

The held-out set (`eval_prompts()`) is a fixed list drawn from its own seed; the training sampler (`sample`)
rejects every expression whose canonical key (the expression text without '=') is held out, so training, including
the supervised warm-up of `grpo.recipes.warmstart`, never sees a held-out item.
"""

from __future__ import annotations

import random
import re
from typing import Optional

from grpo.tasks.prompts import Prompt, Task

# The whole completion must be one canonical integer with at most whitespace around it (see ArithmeticTask).
_ANSWER = re.compile(r"[ \t\n]*(-?(?:0|[1-9][0-9]*))[ \t\n]*")
# Longest integer we accept (3 operands of <= 3 digits give at most 4 digits): blocks digit-flooding.
_MAX_ANSWER_CHARS = 6


def parse_answer(completion: str) -> Optional[int]:
    """The integer a completion states, or None when it is not exactly one answer in the task's format.

    Accepted: optional spaces/tabs/newlines, then ``-?(0|[1-9][0-9]*)`` (no '+', no leading zeros, no '-0'), then
    optional spaces/tabs/newlines, nothing else. Rejected: two numbers ("12 13"), hedges ("maybe 12"), words,
    punctuation, trailing junk ("12=", "12."), another expression ("12+1"), more than 6 characters of number.
    """
    m = _ANSWER.fullmatch(completion)
    if m is None:
        return None
    number = m.group(1)
    if number == "-0" or len(number) > _MAX_ANSWER_CHARS:
        return None
    return int(number)


def canonical_key(expression: str) -> str:
    """The identity of an item: its expression without spaces and without the trailing '='."""
    return expression.replace(" ", "").rstrip("=")


class ArithmeticTask(Task):
    """Integer + / - expressions with `min_operands`..`max_operands` operands of `min_digits`..`max_digits` digits,
    each operator drawn from `operators` ("+-", or "+" for sums only).

    Answer format (what `ArithmeticCorrectReward` and `ArithmeticFormatReward` accept): the completion is the
    result as a plain integer, e.g. ``132`` or ``-7``: no '+' sign, no leading zeros, whitespace around it allowed,
    nothing else (the model ends it with its end-of-sequence token). Prompts are ``"<expression>="`` with no spaces.

    The generator is a pure function of the `random.Random` it is given. The held-out set is `heldout_size` distinct
    items drawn from `heldout_seed`; `sample` never returns one of them (rejection by canonical key).
    """

    def __init__(
        self,
        min_operands: int = 2,
        max_operands: int = 2,
        max_digits: int = 2,
        min_digits: int = 2,
        heldout_size: int = 500,
        heldout_seed: int = 20261122,
        operators: str = "+-",
    ) -> None:
        if not 2 <= min_operands <= max_operands <= 4:
            raise ValueError(f"ArithmeticTask needs 2 <= min_operands <= max_operands <= 4, got {min_operands}, {max_operands}")
        if not 1 <= max_digits <= 3:
            raise ValueError(f"ArithmeticTask.max_digits must be 1..3, got {max_digits}")
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"ArithmeticTask needs 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if not operators or set(operators) - set("+-"):
            raise ValueError(f"ArithmeticTask.operators must be made of '+' and '-', got {operators!r}")
        if heldout_size < 1:
            raise ValueError(f"ArithmeticTask.heldout_size must be >= 1, got {heldout_size}")
        self.min_operands = min_operands
        self.max_operands = max_operands
        self.max_digits = max_digits
        self.min_digits = min_digits
        self.heldout_size = heldout_size
        self.heldout_seed = heldout_seed
        self.operators = operators
        self._heldout = self._draw_heldout()
        self._heldout_keys = frozenset(canonical_key(p.text) for p in self._heldout)

    def _draw_one(self, rng: random.Random) -> Prompt:
        n = rng.randint(self.min_operands, self.max_operands)
        # Digits first, then the value: every digit count is equally common, so short (easy) operands are not rare.
        operands = [self._draw_operand(rng, rng.randint(self.min_digits, self.max_digits)) for _ in range(n)]
        ops = [rng.choice(self.operators) for _ in range(n - 1)]
        text = str(operands[0])
        value = operands[0]
        for op, x in zip(ops, operands[1:]):
            text += f"{op}{x}"
            value = value + x if op == "+" else value - x
        return Prompt(f"{text}=", str(value))

    @staticmethod
    def _draw_operand(rng: random.Random, digits: int) -> int:
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def _draw_heldout(self) -> list[Prompt]:
        rng = random.Random(f"arith-heldout:{self.heldout_seed}")
        seen: set[str] = set()
        items: list[Prompt] = []
        for _ in range(self.heldout_size * 100):
            p = self._draw_one(rng)
            key = canonical_key(p.text)
            if key not in seen:
                seen.add(key)
                items.append(p)
                if len(items) == self.heldout_size:
                    return items
        raise ValueError(
            f"ArithmeticTask: could not draw {self.heldout_size} distinct held-out items; raise max_digits or max_operands"
        )

    def is_heldout(self, prompt_text: str) -> bool:
        """True when the expression belongs to the held-out set."""
        return canonical_key(prompt_text) in self._heldout_keys

    def can_sample(self, prompt: Prompt) -> bool:
        """True when `sample` may draw `prompt`: an expression of this task's shape that is not held out (the
        evaluation component checks its eval set against it)."""
        digits = rf"\d{{{self.min_digits},{self.max_digits}}}"
        shape = rf"{digits}(?:[+-]{digits}){{{self.min_operands - 1},{self.max_operands - 1}}}="
        return re.fullmatch(shape, prompt.text) is not None and not self.is_heldout(prompt.text)

    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out set (same list on every call and every machine), never drawn by `sample`."""
        return list(self._heldout)

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < n:
            p = self._draw_one(rng)
            if canonical_key(p.text) not in self._heldout_keys:
                out.append(p)
        return out


class ArithmeticCorrectReward:
    """1.0 when the completion is exactly one integer in ArithmeticTask's format and equals the answer, else 0.0."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if prompt.answer is None:
            return 0.0
        got = parse_answer(completion)
        return 1.0 if got is not None and got == int(prompt.answer) else 0.0


class ArithmeticFormatReward:
    """1.0 when the completion is exactly one integer in ArithmeticTask's format (right or wrong), else 0.0.

    Keep its weight small (conf/data/arithmetic.yaml: 0.1): it only keeps the format, correctness dominates.
    """

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if parse_answer(completion) is not None else 0.0


def careless_answer(expression: str) -> str:
    """The answer of a solver who works column by column and never carries or borrows (a classic student error).

    Left to right over `expression` (``"47+85"``, no '='): for a sum of like signs each column is (a + b) mod 10, for a
    difference each column is |a - b|; the sign is the true result's. Items without a carry or a borrow come out right
    (``"12+34"`` -> ``"46"``), the others wrong (``"47+85"`` -> ``"22"``, ``"52-27"`` -> ``"35"``).
    """
    numbers = [int(x) for x in re.findall(r"\d+", expression)]
    ops = re.findall(r"[+-]", expression)
    value = numbers[0]
    for op, x in zip(ops, numbers[1:]):
        exact = value + x if op == "+" else value - x
        adding = (op == "+") == (value >= 0)  # |value| and x grow together, else one is taken from the other
        a, b, digits, place = abs(value), x, 0, 1
        while a or b:
            da, db = a % 10, b % 10
            digits += ((da + db) % 10 if adding else abs(da - db)) * place
            a, b, place = a // 10, b // 10, place * 10
        value = digits if exact >= 0 else -digits
    return str(value)


class CarelessTeacher:
    """Answers for the supervised warm-up: the right one, or with probability `share` `careless_answer`'s.

    Why: a model imitating this teacher learns both procedures, and on items with a carry or a borrow it mostly
    follows the careless one (greedy accuracy starts low) while its samples contain the right answer often enough
    for GRPO to find and reinforce it. That is the situation RL fine-tuning is used for: a model that has seen the
    skill done right, among worse habits, and a reward that tells them apart (grpo.recipes.warmstart).
    """

    def __init__(self, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"CarelessTeacher.share must be in [0, 1], got {share}")
        self.share = share

    def __call__(self, prompt: Prompt, rng: random.Random) -> str:
        """The answer the teacher writes for `prompt` (draws from `rng` once)."""
        if rng.random() < self.share:
            return careless_answer(canonical_key(prompt.text))
        return str(prompt.answer)

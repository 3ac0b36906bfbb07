"""The built-in multi-turn example (data=calculator): arithmetic on numbers too long for the model, with a calculator.

A prompt asks for e.g. ``482*771``. The model may call the calculator by writing a turn ``calc: <expression>``;
the environment answers with the value as a ``tool`` message, and the model goes on. Any other turn is the model's
answer, which ends the episode; `LongAnswerReward` grades it (exactly the integer). With `tool: false` the prompt does
not mention the calculator and the first turn is always the answer: the same task without the tool.

The calculator is safe by construction: `evaluate` tokenizes the text by hand (integers, ``+ - *``, parentheses,
spaces), parses it with a recursive-descent parser and computes with Python integers; no eval, no shell, no network.
Sizes are bounded (expression length, digits of every number and of every intermediate result), so a hostile
expression such as ``9999999999*9999999999*...`` is refused, not computed.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional, Union

from grpo.tasks.environment import EnvironmentTask, Episode, Finish, Reply, TurnRenderer
from grpo.tasks.prompts import Prompt, render_chat

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 60  # of any number in an expression and of any intermediate result
# ASCII digits only, as `parse_integer` reads them: "٣*٤" is refused, not computed.
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*()]))")
CALL_PREFIX = "calc:"
_INTEGER = re.compile(r"\s*(-?(?:0|[1-9][0-9]*))\s*")

TOOL_INSTRUCTION = "Write calc: <expression> to use the calculator (+ - * on integers). Answer with the integer alone."


class CalculatorError(ValueError):
    """The expression is not one the calculator computes; the message says why (it is the tool's answer)."""


def _tokens(text: str) -> list[Union[int, str]]:
    if not isinstance(text, str):
        raise CalculatorError(f"the expression must be text, got {type(text).__name__}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    out: list[Union[int, str]] = []
    pos, text = 0, text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise CalculatorError(f"unexpected {text[pos:].strip()[:1]!r}")
        number, op = m.groups()
        if number is not None and len(number) > MAX_DIGITS:
            raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
        out.append(int(number) if number is not None else op)
        pos = m.end()
    if not out:
        raise CalculatorError("empty expression")
    return out


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor ('*' factor)*; factor := ['-'] (integer | '(' expr ')')."""

    def __init__(self, tokens: list[Union[int, str]]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def _peek(self) -> Union[int, str, None]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> Union[int, str, None]:
        token = self._peek()
        self.pos += 1
        return token

    @staticmethod
    def _bounded(value: int) -> int:
        if len(str(abs(value))) > MAX_DIGITS:
            raise CalculatorError(f"a result has more than {MAX_DIGITS} digits")
        return value

    def expression(self) -> int:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self._take()
            value = self._bounded(value + self.term() if op == "+" else value - self.term())
        return value

    def term(self) -> int:
        value = self.factor()
        while self._peek() == "*":
            self._take()
            value = self._bounded(value * self.factor())
        return value

    def factor(self) -> int:
        token = self._take()
        if token == "-":
            return -self.factor()
        if token == "(":
            self.depth += 1
            if self.depth > 20:
                raise CalculatorError("parentheses nested too deep")
            value = self.expression()
            if self._take() != ")":
                raise CalculatorError("missing ')'")
            self.depth -= 1
            return value
        if isinstance(token, int):
            return token
        raise CalculatorError("expected a number" if token is None else f"unexpected {token!r}")


def evaluate(expression: str) -> int:
    """The value of an integer expression of ``+ - *`` and parentheses; CalculatorError for anything else."""
    parser = _Parser(_tokens(expression))
    value = parser.expression()
    if parser.pos != len(parser.tokens):
        raise CalculatorError(f"unexpected {parser.tokens[parser.pos]!r}")
    return value


def call_expression(turn: str) -> Optional[str]:
    """The expression of a turn ``calc: <expression>`` (spaces around either part allowed), or None for any other
    turn. Linear in the turn's length (string methods, no backtracking regex), so a long turn costs no more to read
    than to receive; `evaluate` then refuses an expression over `MAX_EXPRESSION_CHARS`."""
    text = turn.strip()
    if not text.startswith(CALL_PREFIX) or len(text) == len(CALL_PREFIX):
        return None
    return text[len(CALL_PREFIX):].strip()


def parse_integer(text: str) -> Optional[int]:
    """The integer `text` states (spaces around it allowed, no leading zeros, no '+'), or None."""
    m = _INTEGER.fullmatch(text)
    if m is None or m.group(1) == "-0" or len(m.group(1)) > MAX_DIGITS:
        return None
    return int(m.group(1))


class CalculatorEpisode(Episode):
    """One episode: a turn ``calc: <expression>`` gets the value (or ``error: ...``) as a `tool_role` message; any
    other turn is the answer. `calls` counts the calculator calls."""

    def __init__(self, tool: bool, tool_role: str) -> None:
        self.tool, self.tool_role, self.calls = tool, tool_role, 0

    def step(self, turn: str) -> Union[Reply, Finish]:
        expression = call_expression(turn) if self.tool else None
        if expression is None:
            return Finish(turn)
        self.calls += 1
        try:
            return Reply(str(evaluate(expression)), self.tool_role)
        except CalculatorError as e:
            return Reply(f"error: {e}", self.tool_role)


class LongArithmeticTask(EnvironmentTask):
    """``a<op>b`` with operands of `min_digits`..`max_digits` digits and `op` drawn from `operators` (``*``, ``+``,
    ``-``), asked as `question` in the chat template; with `tool` the system turn explains the calculator
    (`TOOL_INSTRUCTION`). Held-out split: `heldout_size` distinct items from `heldout_seed`, never drawn by `sample`."""

    def __init__(self, min_digits: int = 3, max_digits: int = 3, operators: str = "*", heldout_size: int = 64,
                 heldout_seed: int = 20261126, question: str = "{expression}=", tool: bool = True,
                 tool_role: str = "tool") -> None:
        if not 1 <= min_digits <= max_digits <= 20:
            raise ValueError(f"LongArithmeticTask needs 1 <= min_digits <= max_digits <= 20, got {min_digits}, {max_digits}")
        if not operators or set(operators) - set("*+-"):
            raise ValueError(f"LongArithmeticTask.operators must be made of '*', '+' and '-', got {operators!r}")
        if heldout_size < 1:
            raise ValueError(f"LongArithmeticTask.heldout_size must be >= 1, got {heldout_size}")
        if "{expression}" not in question:
            raise ValueError(f"LongArithmeticTask.question must contain {{expression}}, got {question!r}")
        self.min_digits, self.max_digits, self.operators = min_digits, max_digits, operators
        self.question, self.tool, self.tool_role = question, bool(tool), tool_role
        self.tokenizer: Any = None
        rng = random.Random(f"long-arith-heldout:{heldout_seed}")
        held: dict[str, str] = {}
        for _ in range(heldout_size * 100):
            expression, answer = self._draw(rng)
            held.setdefault(expression, answer)
            if len(held) == heldout_size:
                break
        else:
            raise ValueError(f"LongArithmeticTask: could not draw {heldout_size} distinct held-out items")
        self._heldout = held

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = (rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1)
                for d in (rng.randint(self.min_digits, self.max_digits) for _ in range(2)))
        op = rng.choice(self.operators)
        expression = f"{a}{op}{b}"
        return expression, str(evaluate(expression))

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, expression: str) -> str:
        """The prompt text of `expression`: `question` as the user turn, after the tool's instruction (with `tool`)."""
        return render_chat(self.tokenizer, self.question.format(expression=expression),
                           TOOL_INSTRUCTION if self.tool else None)

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < n:
            expression, answer = self._draw(rng)
            if expression not in self._heldout:
                out.append(Prompt(self.render(expression), answer))
        return out

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(self.render(e), a) for e, a in self._heldout.items()]

    def expression_of(self, prompt: Prompt) -> Optional[str]:
        """The expression `prompt` asks for (a prompt this task renders), or None."""
        digits = rf"\d{{{self.min_digits},{self.max_digits}}}"
        for expression in re.findall(rf"{digits}[{re.escape(self.operators)}]{digits}", prompt.text):
            if prompt.text == self.render(expression):
                return expression
        return None

    def can_sample(self, prompt: Prompt) -> bool:
        expression = self.expression_of(prompt)
        return expression is not None and expression not in self._heldout

    def start(self, prompt: Prompt) -> CalculatorEpisode:
        return CalculatorEpisode(self.tool, self.tool_role)


class LongAnswerReward:
    """1.0 when the answer is exactly the reference integer (spaces around it allowed), else 0.0."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        got = parse_integer(completion)
        return 1.0 if prompt.answer is not None and got is not None and got == int(prompt.answer) else 0.0

    def parses(self, prompt: Prompt, completion: str) -> bool:
        """Whether the answer states an integer at all (eval/unparsed_fraction)."""
        return parse_integer(completion) is not None


class CalculatorTeacher:
    """Whole teacher episodes for the calculator's warm start (grpo.recipes.warmstart, preset warm-calc).

    A `plain_share` of the episodes ask without the tool (the task's question alone) and answer the product at once;
    the others offer the tool and, in `call_share` of them, call it (``calc: <expression>``), get the value as the
    tool's message and copy it as the answer, else answer the product at once. Every answer is right, so the model
    learns to try the product itself (all it has without the tool) and to copy a call and the tool's value exactly;
    a low `call_share` last makes calling rare, which GRPO then has to find worth it.
    """

    def __init__(self, call_share: float, plain_share: float) -> None:
        if not (0.0 <= call_share <= 1.0 and 0.0 <= plain_share <= 1.0):
            raise ValueError(f"CalculatorTeacher shares must be in [0, 1], got {call_share}, {plain_share}")
        self.call_share, self.plain_share = call_share, plain_share

    def episode(self, task: LongArithmeticTask, prompt: Prompt, rng: random.Random, tokenizer: Any
                ) -> tuple[list[int], list[int]]:
        """(token ids, labels) of one episode of `prompt`, the labels -100 outside the model's turns."""
        expression = task.expression_of(prompt)
        if expression is None:
            raise ValueError(f"CalculatorTeacher: {prompt.text!r} is not a prompt of the task")
        eos = tokenizer.eos_token_id
        plain = rng.random() < self.plain_share
        text = render_chat(tokenizer, task.question.format(expression=expression)) if plain else prompt.text
        ids = tokenizer.encode(text, add_special_tokens=False)
        labels = [-100] * len(ids)

        def model_turn(turn: str) -> None:
            tokens = tokenizer.encode(turn, add_special_tokens=False) + [eos]
            ids.extend(tokens)
            labels.extend(tokens)

        if not plain and rng.random() < self.call_share:
            model_turn(f"{CALL_PREFIX} {expression}")
            tool = TurnRenderer(tokenizer).tokens(task.tool_role, str(evaluate(expression)))
            ids.extend(tool)
            labels.extend([-100] * len(tool))
        model_turn(str(prompt.answer))
        return ids, labels

"""Arithmetic questions for a real instruct model, asked through its chat template and graded with math-verify.

`ArithmeticTask` is written for the tiny byte-level model: the prompt is ``47+85=`` and the completion must be the bare
integer. A pretrained chat model is asked a question instead (``What is 47 + 85?``), in its chat template with a
system prompt that `system_prompt` controls, and may answer in words, LaTeX or a sentence: `MathVerifyReward` grades
whatever it writes with Hugging Face's `math-verify`, the grader of the field's math environments.

The items, the held-out set and the rule that training never draws a held-out item are `ArithmeticTask`'s (same
generator, same seeds): only the rendering differs.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional

from grpo.tasks.arithmetic import ArithmeticTask
from grpo.tasks.prompts import Prompt, render_chat

# The expression inside a rendered question: "47 + 85" or "12 - 7 + 30".
_EXPRESSION = re.compile(r"\d+(?: [+-] \d+)+")


def spaced(expression: str) -> str:
    """``47+85=`` -> ``47 + 85`` (how people write it in a question)."""
    return re.sub(r"([+-])", r" \1 ", expression.rstrip("="))


class ChatArithmeticTask(ArithmeticTask):
    """`ArithmeticTask`'s items as chat questions: `question` with ``{expression}`` filled in, as the user turn of the
    tokenizer's chat template, after `system_prompt` (None: the template's own default, e.g. SmolLM2's "You are a
    helpful AI assistant named SmolLM..."; "" : an empty system turn). The reference answer is the integer."""

    def __init__(self, question: str = "What is {expression}?", system_prompt: Optional[str] = None,
                 **arithmetic: Any) -> None:
        if "{expression}" not in question:
            raise ValueError(f"ChatArithmeticTask.question must contain {{expression}}, got {question!r}")
        self.question = question
        self.system_prompt = system_prompt
        self.tokenizer: Any = None
        super().__init__(**arithmetic)

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, expression: str) -> str:
        """The prompt text the model continues for `expression` (``47+85=``)."""
        user = self.question.format(expression=spaced(expression))
        return render_chat(self.tokenizer, user, self.system_prompt)

    def _chat(self, items: list[Prompt]) -> list[Prompt]:
        return [Prompt(self.render(p.text), p.answer) for p in items]

    def eval_prompts(self) -> list[Prompt]:
        return self._chat(super().eval_prompts())

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        return self._chat(super().sample(rng, n))

    def can_sample(self, prompt: Prompt) -> bool:
        """True when `prompt` renders an item of this task's shape that is not held out."""
        found = _EXPRESSION.findall(prompt.text)
        if not found:
            return False
        expression = found[-1].replace(" ", "") + "="
        return prompt.text == self.render(expression) and super().can_sample(Prompt(expression))

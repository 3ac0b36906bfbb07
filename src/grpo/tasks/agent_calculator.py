"""The calculator task as an OpenAI-API agent (data=agent_calculator; docs/agents.md).

`calculator_agent` is an ordinary `openai` SDK agent: it offers the model a ``calculator`` tool, runs each call the
model makes (grpo.tasks.calculator.evaluate: integers, ``+ - *``, parentheses; no eval) and sends the result back
as a ``tool`` message, until the model answers without a call; the episode scores 1.0 when the answer is exactly the
integer. `calculator_agent_without_tool` is the same task without the tool (one request, the question alone): the
baseline the tool is measured against. `CalculatorQuestions` is the calculator task's items as bare questions (``482*771=``) with their answers.
`AgentCalculatorTeacher` writes the agent's episodes as OpenAI messages, for a warm start (grpo.recipes.warmstart).
"""

from __future__ import annotations

import json
import random
from typing import Any

from grpo.tasks.calculator import CalculatorError, LongArithmeticTask, evaluate, parse_integer
from grpo.tasks.prompts import Prompt

SYSTEM = "Use the calculator tool for arithmetic. Answer with the integer alone."
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "The value of an integer expression of + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_TURNS = 3


class CalculatorQuestions(LongArithmeticTask):
    """The items of `LongArithmeticTask` (same draws, same held-out split) as bare questions: `Prompt.text` is the
    question (``482*771=``), not a rendered chat prompt; the agent writes its own messages."""

    def render(self, expression: str) -> str:
        return self.question.format(expression=expression)


def calculator(arguments: str) -> str:
    """The calculator tool: the value of ``{"expression": ...}``, or ``error: ...``."""
    try:
        return str(evaluate(json.loads(arguments)["expression"]))
    except (CalculatorError, ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


async def calculator_agent(client: Any, item: Prompt) -> float:
    """One episode: ask, run the model's calculator calls, score the final answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item.text}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(parse_integer(message.content or "") == int(item.answer))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    return 0.0


async def calculator_agent_without_tool(client: Any, item: Prompt) -> float:
    """One episode without the tool: the question alone (no system message, no tools), the answer scored."""
    response = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.text}])
    return float(parse_integer(response.choices[0].message.content or "") == int(item.answer))


class AgentCalculatorTeacher:
    """Demonstrations of `calculator_agent`'s episodes as OpenAI chat messages (grpo.recipes.warmstart renders them
    with the agent's chat template, so a warm start learns the agent's own call format).

    Every episode is asked as the agent asks (its system message, the tool offered). In `call_share` of them the
    assistant calls ``calculator`` with the question's expression, gets the tool's value and answers with it; in the
    others it answers the product at once. Every answer is right, so the model learns to call and copy exactly and
    to try the product itself, which it cannot do (3-digit products are not learnt from a few hundred examples):
    with a share of calls below 1 its sampled episodes disagree (calls right, guesses wrong) and GRPO has calling to
    find worth it. No episode is asked without the tool (no system message, no tools), so the task without the tool
    (`calculator_agent_without_tool`) is never demonstrated."""

    tools = [CALCULATOR_TOOL]

    def __init__(self, call_share: float = 1.0) -> None:
        if not 0.0 <= call_share <= 1.0:
            raise ValueError(f"AgentCalculatorTeacher.call_share must be in [0, 1], got {call_share}")
        self.call_share = call_share

    def messages(self, task: CalculatorQuestions, prompt: Prompt, rng: random.Random, call: bool | None = None
                 ) -> list[dict[str, Any]]:
        """The episode of `prompt` (an item of `task`): one that calls when `call`, else drawn by `call_share`."""
        expression = task.expression_of(prompt)
        if expression is None:
            raise ValueError(f"AgentCalculatorTeacher: {prompt.text!r} is not an item of the task")
        asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt.text}]
        if not (call if call is not None else rng.random() < self.call_share):
            return [*asked, {"role": "assistant", "content": str(prompt.answer)}]
        tool_call = {"id": "call_0", "type": "function",
                     "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
        return [*asked, {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": "call_0", "content": calculator(tool_call["function"]["arguments"])},
                {"role": "assistant", "content": str(prompt.answer)}]

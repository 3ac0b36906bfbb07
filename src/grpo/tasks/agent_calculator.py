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

    Every episode calls the tool: the system message and the question as the agent sends them, an assistant turn
    holding one ``calculator`` call of the question's expression, the tool's value, and that value as the answer.
    No episode states a product the tool did not give, and none is asked without the tool, so the warm start learns
    to call and to copy, not the products: the same task without the tool (`calculator_agent_without_tool`) stays
    what the model did before."""

    tools = [CALCULATOR_TOOL]

    def messages(self, task: CalculatorQuestions, prompt: Prompt, rng: random.Random) -> list[dict[str, Any]]:
        """The episode of `prompt` (an item of `task`); `rng` is unused (every episode calls)."""
        expression = task.expression_of(prompt)
        if expression is None:
            raise ValueError(f"AgentCalculatorTeacher: {prompt.text!r} is not an item of the task")
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt.text},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": calculator(call["function"]["arguments"])},
                {"role": "assistant", "content": str(prompt.answer)}]

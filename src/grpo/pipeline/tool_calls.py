"""Tool calls in the OpenAI format from a model's text, for the agent endpoint (grpo.pipeline.agent_endpoint).

Three parsers, chosen by `data.tool_parser`:

- ``json_tags`` (the built-in one, for models without a parser of their own, as the tiny test models): a call is a
  block ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes' and Qwen's format, spaces and newlines
  around the JSON allowed); the text before the first block is the message's content. A block whose JSON is not an
  object with a string ``name`` and an object ``arguments`` is not a call: the whole text stays content.
- the name of one of vLLM's tool parsers (``hermes``, ``llama3_json``, ``mistral``, ...: vLLM's
  ``--tool-call-parser`` names), used as vLLM's own OpenAI server uses it on a whole completion.

`CHATML_TOOLS_TEMPLATE` (``data.chat_template=chatml_tools``) is a ChatML chat template that renders tools, calls
in the ``json_tags`` format and ``tool`` messages, for tokenizers whose own template has no tools (the tiny models).

``calc_lines`` (template and parser of that name) is the format the calculator's warm start (model=warm_calc) was
trained on (grpo.tasks.calculator): the tools are announced by the calculator's one-line instruction as the
system turn (in place of the request's own system message), a call is a turn ``calc: <expression>`` of the
``calculator`` tool (``{"expression": ...}``), the tool's answer a turn of role ``tool``. An agent with that tool
then reaches the warm start with the very prompts of data=calculator.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

JSON_TAGS = "json_tags"

# ChatML with tools: the tool list in the system turn, an assistant turn's calls as <tool_call> blocks after its
# content (one newline between), and tool results as turns of role "tool". What `parse_json_tags` reads back.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these tools, each as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message.role != 'system' %}"
    "<|im_start|>{{ message.role }}\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.role == 'assistant' and message.tool_calls %}{% for call in message.tool_calls %}"
    "{% if message.content or not loop.first %}\n{% endif %}"
    "<tool_call>{\"name\": {{ call.function.name | tojson }}, \"arguments\": {{ call.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CALC_LINES = "calc_lines"
# The system turn of data=calculator's prompts with the tool (grpo.tasks.calculator.TOOL_INSTRUCTION, kept equal
# by tests/test_agents.py) and its call prefix.
CALC_INSTRUCTION = "Write calc: <expression> to use the calculator (+ - * on integers). Answer with the integer alone."
CALC_PREFIX = "calc:"
CALC_LINES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n" + CALC_INSTRUCTION + "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message.role != 'system' %}"
    "<|im_start|>{{ message.role }}\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.role == 'assistant' and message.tool_calls %}{% for call in message.tool_calls %}"
    "{% if message.content or not loop.first %}\n{% endif %}"
    "calc: {{ call.function.arguments.expression }}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN_TEMPLATES = {"chatml_tools": CHATML_TOOLS_TEMPLATE, CALC_LINES: CALC_LINES_TEMPLATE}

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn as an OpenAI assistant message: its content (None when it holds only calls) and its calls
    (``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``)."""

    content: Optional[str]
    tool_calls: list[dict[str, Any]]


def _call(name: str, arguments: Any, call_id: str) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def parse_json_tags(text: str, id_prefix: str) -> ParsedTurn:
    """The ``json_tags`` parser (module docstring); calls get ids ``<id_prefix>_<i>``."""
    blocks = list(_BLOCK.finditer(text))
    calls = []
    for i, block in enumerate(blocks):
        try:
            body = json.loads(block.group(1))
        except json.JSONDecodeError:
            return ParsedTurn(text, [])
        if not (isinstance(body, dict) and isinstance(body.get("name"), str) and isinstance(body.get("arguments"), dict)):
            return ParsedTurn(text, [])
        calls.append(_call(body["name"], body["arguments"], f"{id_prefix}_{i}"))
    if not calls:
        return ParsedTurn(text, [])
    content = text[:blocks[0].start()].removesuffix("\n")
    return ParsedTurn(content or None, calls)


def parse_calc_lines(text: str, id_prefix: str) -> ParsedTurn:
    """The ``calc_lines`` parser (module docstring): a turn ``calc: <expression>`` (spaces around either part
    allowed) is one call of ``calculator``; any other turn is content."""
    turn = text.strip()
    if not turn.startswith(CALC_PREFIX) or not turn[len(CALC_PREFIX):].strip():
        return ParsedTurn(text, [])
    return ParsedTurn(None, [_call("calculator", {"expression": turn[len(CALC_PREFIX):].strip()}, f"{id_prefix}_0")])


class ToolParser:
    """Parses a finished model turn into a `ParsedTurn` with the parser `name` (module docstring)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self._vllm = None if name in (JSON_TAGS, CALC_LINES) else _vllm_parser(name, tokenizer)

    def parse(self, text: str, request: dict[str, Any], id_prefix: str) -> ParsedTurn:
        """`text` (the turn without its end-of-turn token) as content and calls; `request`: the chat request's body
        (vLLM's parsers read its tools)."""
        if self.name == CALC_LINES:
            return parse_calc_lines(text, id_prefix)
        if self._vllm is None:
            return parse_json_tags(text, id_prefix)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        info = self._vllm.extract_tool_calls(text, ChatCompletionRequest(**request))
        if not info.tools_called:
            return ParsedTurn(text, [])
        calls = [_call(c.function.name, c.function.arguments, c.id or f"{id_prefix}_{i}")
                 for i, c in enumerate(info.tool_calls)]
        return ParsedTurn(info.content or None, calls)


def _vllm_parser(name: str, tokenizer: Any) -> Any:
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError as e:
        raise ValueError(f"data.tool_parser={name!r} is one of vLLM's tool parsers, but vLLM's tool_parsers do not "
                         f"import here ({e}); use data.tool_parser={JSON_TAGS}") from e
    try:
        parser_class = ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise ValueError(f"data.tool_parser={name!r} is neither {JSON_TAGS!r}, {CALC_LINES!r} nor a vLLM tool parser; vLLM has: "
                         f"{', '.join(ToolParserManager.list_registered())}") from None
    try:
        return parser_class(tokenizer)
    except Exception as e:  # vLLM's parsers refuse a tokenizer without their special tokens
        raise ValueError(f"vLLM's tool parser {name!r} refuses this model's tokenizer: {e}; use "
                         f"data.tool_parser={JSON_TAGS} with a chat template that writes its format") from e

"""The prompt token ids of an agent's chat request (grpo.pipeline.agent_endpoint), rendered and tokenized here.

The request's messages (and tools) are rendered with the chat template (the tokenizer's own, or `data.chat_template`:
a built-in name of grpo.pipeline.tool_calls or a Jinja file), ready for the assistant's turn. Where that text begins
with an earlier call's prompt text followed by the text of its completion, the earlier call's token ids (prompt and
sampled tokens, as the model saw and produced them) are kept and only the rest is tokenized: a conversation that
grows turn by turn reaches the model as the tokens it sampled, never re-tokenized. Where it does not (the template
dropped an earlier `<think>` block, the history was edited or cut), the whole text is tokenized afresh: the call
then starts a sample of its own (grpo.pipeline.agent_samples).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from grpo.pipeline.tool_calls import BUILTIN_TEMPLATES


@dataclass(frozen=True)
class RenderedCall:
    """What a call's prompt and completion read as text (to match a later call's prompt against) and its ids."""

    prompt_text: str
    completion_text: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]


def resolve_template(tokenizer: Any, chat_template: Optional[str]) -> Optional[str]:
    """The Jinja chat template to render with: `chat_template` (a built-in name or a file), else the tokenizer's."""
    if chat_template is None:
        return getattr(tokenizer, "chat_template", None)
    if chat_template in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[chat_template]
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise ValueError(f"data.chat_template={chat_template!r} is neither a built-in template "
                         f"({', '.join(BUILTIN_TEMPLATES)}) nor a file")
    return path.read_text(encoding="utf-8")


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat templates read them: a call's `arguments` JSON string as an object (as vLLM's own server
    hands them to the template), content given as a list of text parts joined into one string."""
    out = []
    for message in messages:
        m = copy.deepcopy(dict(message))
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        for call in m.get("tool_calls") or []:
            function = call.get("function") or {}
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # rendered as the string it is
        out.append(m)
    return out


class ChatPrompts:
    """Renders chat requests into prompt token ids, keeping earlier calls' tokens where the text extends them."""

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.template = resolve_template(tokenizer, chat_template)

    def render(self, messages: Sequence[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> str:
        """The text of `messages` (and `tools`) ready for the assistant's turn."""
        if not self.template:
            raise ValueError("the model's tokenizer has no chat template; set data.chat_template (e.g. chatml_tools) "
                             "or send /v1/completions requests")
        if tools and "tools" not in self.template:
            raise ValueError("the request has tools but the chat template does not render them; set "
                             "data.chat_template to one that does (e.g. chatml_tools)")
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(template_messages(messages), chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=True, **kwargs)

    def completion_text(self, completion_ids: Sequence[int]) -> str:
        """The text of sampled tokens as a template would write them back (special tokens kept)."""
        return self.tokenizer.decode(list(completion_ids), skip_special_tokens=False)

    def prompt_ids(self, text: str, earlier: Sequence[RenderedCall]) -> list[int]:
        """The token ids of prompt `text`: the latest earlier call whose prompt and completion text it begins with,
        its ids and then the rest tokenized; else `text` tokenized whole."""
        for call in reversed(earlier):
            head = call.prompt_text + call.completion_text
            if text.startswith(head):
                rest = self.tokenizer.encode(text[len(head):], add_special_tokens=False) if len(text) > len(head) else []
                return [*call.prompt_ids, *call.completion_ids, *rest]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

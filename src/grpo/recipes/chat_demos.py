"""Chat demonstrations for a warm start (grpo.recipes.warmstart): a teacher's episodes, written as OpenAI messages,
rendered and tokenized exactly as the agent endpoint renders an agent's requests, and measured the same way.

A chat teacher has ``messages(task, prompt, rng, call=None) -> list of OpenAI messages`` (the whole episode: system
and user messages, assistant turns with content or ``tool_calls``, ``tool`` results; ``call=True``: an episode that
calls a tool, for the measure) and ``tools`` (the OpenAI tool list its agent sends). Each assistant turn becomes what the endpoint would have recorded for it: the prompt token ids of
`grpo.pipeline.chat_prompts.ChatPrompts` (the chat template the run uses, earlier turns' tokens kept where the text
extends them) and the turn's text as the template writes it, ended by the end-of-turn token. Only those turns'
tokens are labelled; the system turn, the question and the tool's results are not.
"""

from __future__ import annotations

import json
import random
from typing import Any, Sequence

from grpo.pipeline.chat_prompts import ChatPrompts, RenderedCall
from grpo.pipeline.tool_calls import parse_json_tags

IGNORE = -100


def encode_chat_episode(chat: ChatPrompts, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
                        ) -> tuple[list[int], list[int]]:
    """(token ids, labels) of a whole episode rendered with `chat`, labels `IGNORE` outside the assistant turns."""
    tokenizer = chat.tokenizer
    eos = tokenizer.eos_token
    ids: list[int] = []
    labels: list[int] = []
    earlier: list[RenderedCall] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt_text = chat.render(messages[:k], tools)
        full = chat.render(messages[:k + 1], tools)
        if not full.startswith(prompt_text) or eos not in full[len(prompt_text):]:
            raise ValueError(f"the chat template does not write assistant turn {k} after its prompt, ended by {eos!r}")
        turn = full[len(prompt_text):].split(eos, 1)[0]
        prompt_ids = chat.prompt_ids(prompt_text, earlier)
        if prompt_ids[:len(ids)] != ids:
            raise ValueError(f"turn {k}'s prompt does not extend the earlier turns' tokens: the template rewrites them")
        completion = tokenizer.encode(turn, add_special_tokens=False) + [tokenizer.eos_token_id]
        labels += [IGNORE] * (len(prompt_ids) - len(ids)) + completion
        ids = prompt_ids + completion
        earlier.append(RenderedCall(prompt_text, chat.completion_text(completion), tuple(prompt_ids), tuple(completion)))
    return ids, labels


class ChatEpisodes:
    """A chat teacher as the warm start's episode teacher: ``episode(task, prompt, rng, tokenizer) -> (ids, labels)``
    of its messages rendered with `chat_template` (a built-in name of grpo.pipeline.tool_calls or a Jinja file)."""

    def __init__(self, teacher: Any, tokenizer: Any, chat_template: str | None) -> None:
        self.teacher, self.chat = teacher, ChatPrompts(tokenizer, chat_template)

    def episode(self, task: Any, prompt: Any, rng: random.Random, tokenizer: Any) -> tuple[list[int], list[int]]:
        return encode_chat_episode(self.chat, self.teacher.messages(task, prompt, rng), self.teacher.tools)


def _first_request(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return list(messages[:first])


def _calls(turn_calls: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn_calls]


def measure_chat(model: Any, tokenizer: Any, task: Any, reward: Any, teacher: Any, chat_template: str | None,
                 cfg: dict[str, Any], seed: int, generate: Any) -> dict[str, float]:
    """What a chat warm start does on held-out items, in transformers: its first turns sampled at `temperature`
    (`sample_n` for each of the first `sample_prompts` items) read by the ``json_tags`` parser: the share that are
    calls, and that are the calls of the teacher's calling episode; and, greedy on every held-out item, the reward of the answer to
    the first request's messages without the system turn and without tools (the task without the tool).
    `generate` is grpo.recipes.warmstart.generate_answers."""
    import torch

    chat = ChatPrompts(tokenizer, chat_template)
    rng = random.Random(f"warmstart-measure:{seed}")
    heldout = task.eval_prompts()
    subset = heldout[: int(cfg["sample_prompts"])]
    episodes = [teacher.messages(task, p, rng, call=True) for p in subset]
    n = int(cfg["sample_n"])
    torch.manual_seed(seed)
    turns = generate(model, tokenizer, [chat.render(_first_request(e), teacher.tools) for e in episodes],
                     cfg["max_new_tokens"], float(cfg["temperature"]), n)
    parsed = [parse_json_tags(t, "m").tool_calls for t in turns]
    wanted = [_calls(next(m for m in e if m["role"] == "assistant").get("tool_calls") or []) for e in episodes]
    bare = [[m for m in _first_request(teacher.messages(task, p, rng, call=True)) if m["role"] != "system"]
            for p in heldout]
    answers = generate(model, tokenizer, [chat.render(b) for b in bare], cfg["max_new_tokens"])
    return {
        "first_turn_call_rate": sum(bool(c) for c in parsed) / len(parsed),
        "first_turn_right_call_rate": sum(bool(c) and _calls(c) == wanted[i // n] for i, c in enumerate(parsed))
        / len(parsed),
        "sample_temperature": float(cfg["temperature"]),
        "no_tool_greedy_accuracy": sum(float(reward(p, a)) for p, a in zip(heldout, answers)) / len(heldout),
        "heldout_items": len(heldout),
    }

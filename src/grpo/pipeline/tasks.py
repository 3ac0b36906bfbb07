"""Prompt sources of the built-in rollout pipeline (conf/data/local_*.yaml `task:`).

A task turns a seeded `random.Random` into prompts; the pipeline tokenizes them, generates and scores. Tasks never
draw from global random state, so the same seed and step always give the same prompts (resume continues the stream).
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

MINI_GSM8K = Path(__file__).parent / "data" / "gsm8k_mini.jsonl"

GSM8K_INSTRUCTION = (
    "Solve the math problem. Think step by step, then give the final answer on its own line as '#### <number>'."
)


@dataclass(frozen=True)
class Prompt:
    """One prompt: the rendered text the model continues, and the reference answer (None when there is none)."""

    text: str
    answer: Optional[str] = None


class Task:
    """Base of the built-in tasks: `sample(rng, n)` returns `n` prompts drawn from `rng` only."""

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Give the task the trainer's tokenizer (used for chat templates). Optional for tasks that need none."""

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        raise NotImplementedError


class DigitsTask(Task):
    """Toy task: a random string of lowercase letters as the prompt, no answer.

    Paired with `DigitFractionReward` it is the smoke test of learning: a random tiny model starts near zero digits
    and learns to emit them within minutes on CPU.
    """

    def __init__(self, prompt_chars: int = 8) -> None:
        if prompt_chars < 1:
            raise ValueError(f"DigitsTask.prompt_chars must be >= 1, got {prompt_chars}")
        self.prompt_chars = prompt_chars

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        letters = string.ascii_lowercase
        return [Prompt("".join(rng.choice(letters) for _ in range(self.prompt_chars))) for _ in range(n)]


def gsm8k_final_answer(answer: str) -> str:
    """The number after GSM8K's '####' marker (commas removed); the whole string stripped when there is no marker."""
    final = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return final.strip().replace(",", "").replace("$", "")


class GSM8KTask(Task):
    """Grade-school math from a JSONL file of `{"question", "answer"}` rows in GSM8K's format ("... #### 42").

    `path=None` uses the small offline set shipped with the package (written for this project, not GSM8K itself);
    point `path` at GSM8K's own `train.jsonl`/`test.jsonl` for the real data set. With `chat_template=True` the
    question is rendered through the tokenizer's chat template (plain text when the tokenizer has none).
    """

    def __init__(self, path: Optional[str] = None, chat_template: bool = True) -> None:
        self.path = Path(path).expanduser() if path else MINI_GSM8K
        self.chat_template = chat_template
        self.tokenizer: Any = None
        self.rows = self._load(self.path)

    @staticmethod
    def _load(path: Path) -> list[tuple[str, str]]:
        if not path.is_file():
            raise FileNotFoundError(f"GSM8KTask: no JSONL file at {path} (expected rows of {{question, answer}})")
        rows = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, answer = str(row["question"]), str(row["answer"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"GSM8KTask: {path}:{lineno} is not a {{question, answer}} JSON row ({e})") from e
            final = gsm8k_final_answer(answer)
            if not re.fullmatch(r"-?\d+(\.\d+)?", final):
                raise ValueError(f"GSM8KTask: {path}:{lineno} has no numeric final answer after '####': {answer!r}")
            rows.append((question, final))
        if not rows:
            raise ValueError(f"GSM8KTask: {path} holds no rows")
        return rows

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, question: str) -> str:
        content = f"{GSM8K_INSTRUCTION}\n\n{question}"
        if self.chat_template and self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        return f"{content}\n\nAnswer:"

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        picks = [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]
        return [Prompt(self.render(q), a) for q, a in picks]

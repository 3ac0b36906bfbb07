"""A small coding task (conf/data/code_tiny.yaml): write a Python function from a one-line description, graded by
hidden tests in the sandbox (grpo.tasks.code_reward.SandboxedTestsReward)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Optional

from grpo.tasks.prompts import Prompt, RowsTask, render_chat

CODE_TINY = Path(__file__).parent / "data" / "code_tiny.jsonl"

CODING_INSTRUCTION = "Write a Python function `{signature}` that {description}. Reply with the code in a ```python block."


class CodingTask(RowsTask):
    """Rows of `{"signature", "description", "tests"}` (JSONL; `path=None` is the small set shipped with the package,
    each row also holding a reference `solution`). The prompt asks for the function; its answer is the test code
    (asserts on the function), which the model never sees. `eval_size` rows, chosen by a hash of their signature, are
    held out of training."""

    def __init__(self, path: Optional[str] = None, chat_template: bool = True, system_prompt: Optional[str] = None,
                 eval_size: int = 8) -> None:
        self.path = str(Path(path).expanduser()) if path else str(CODE_TINY)
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.tokenizer: Any = None
        rows = self._load(self.path)
        if not 0 <= eval_size < len(rows):
            raise ValueError(f"CodingTask.eval_size must be in [0, {len(rows)}) for the {len(rows)} rows of "
                             f"{self.path}, got {eval_size}")
        order = sorted(range(len(rows)), key=lambda i: hashlib.sha256(rows[i][0].encode()).hexdigest())
        held = set(order[:eval_size])
        self.rows = [r for i, r in enumerate(rows) if i not in held]
        self.eval_rows = [r for i, r in enumerate(rows) if i in held]

    @staticmethod
    def _load(path: str) -> list[tuple[str, str]]:
        """(question, tests) per row; the question is the instruction with the row's signature and description."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"CodingTask: no JSONL file at {path} (rows of {{signature, description, tests}})")
        rows = []
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                question = CODING_INSTRUCTION.format(signature=row["signature"], description=row["description"])
                rows.append((question, str(row["tests"])))
            except KeyError as e:
                raise ValueError(f"CodingTask: {path}:{n} has no {e} (rows of {{signature, description, tests}})") from e
        if not rows:
            raise ValueError(f"CodingTask: {path} holds no rows")
        return rows

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, question: str) -> str:
        if self.chat_template and self.tokenizer is not None:
            return render_chat(self.tokenizer, question, self.system_prompt)
        return f"{question}\n\nAnswer:"

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        picks = [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]
        return [Prompt(self.render(q), tests) for q, tests in picks]

    def eval_prompts(self) -> list[Prompt]:
        if not self.eval_rows:
            raise ValueError("CodingTask.eval_size=0: no held-out rows; set data.task.eval_size > 0 or eval.enabled=false")
        return [Prompt(self.render(q), tests) for q, tests in self.eval_rows]

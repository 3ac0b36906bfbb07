"""Prompt sources of the built-in rollout pipeline (conf/data/local_*.yaml `task:`).

A task turns a seeded `random.Random` into prompts; the pipeline tokenizes them, generates and scores. Tasks never
draw from global random state, so the same seed and step always give the same prompts (resume continues the stream).
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from grpo.config_values import CheckContext
from grpo.tasks.hf_datasets import load_rows

MINI_GSM8K = Path(__file__).parent / "data" / "gsm8k_mini.jsonl"

GSM8K_INSTRUCTION = (
    "Solve the math problem. Think step by step, then give the final answer on its own line as '#### <number>'."
)


def render_chat(tokenizer: Any, user: str, system_prompt: Optional[str] = None) -> str:
    """`user` as the user turn of the tokenizer's chat template, ready for the assistant's answer. `system_prompt`:
    None keeps the template's own default (some templates insert one, e.g. SmolLM2's), a string is the system turn.
    A tokenizer without a chat template gets plain text (`system_prompt`, the question, then "Answer:")."""
    if not getattr(tokenizer, "chat_template", None):
        head = f"{system_prompt}\n\n" if system_prompt else ""
        return f"{head}{user}\n\nAnswer:"
    messages = [{"role": "user", "content": user}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class Prompt:
    """One prompt: the rendered text the model continues, and the reference answer (None when there is none)."""

    text: str
    answer: Optional[str] = None


class Task:
    """Base of the built-in tasks: `sample(rng, n)` returns `n` prompts drawn from `rng` only.

    A task with a held-out split also implements `eval_prompts()` (a fixed list `sample` never draws) and
    `can_sample(prompt)` (whether `sample` may ever draw that prompt), which the evaluator uses to prove the split.
    """

    @classmethod
    def check_config(cls, cfg: Any, ctx: CheckContext) -> None:
        """Checks of the task's config node (`ctx.node(cfg)`, found at `ctx.key`: data.task or eval.task) before
        anything is built: a ConfigError (grpo.config_values) saying what to set. None by default."""

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Give the task the trainer's tokenizer (used for chat templates). Optional for tasks that need none."""

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        raise NotImplementedError

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts: fixed, deterministic, never drawn by `sample`."""
        raise NotImplementedError(f"{type(self).__name__} has no held-out split (eval_prompts); set eval.enabled=false")

    def can_sample(self, prompt: Prompt) -> bool:
        """True when `sample` may draw `prompt` (used to check that an eval set is disjoint from training)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say which prompts it samples: implement can_sample(prompt) so that the "
            "held-out prompts can be checked against training, or set eval.enabled=false"
        )


class DigitsTask(Task):
    """Toy task: a random string of lowercase letters as the prompt, no answer.

    Paired with `DigitFractionReward` it is the smoke test of learning: a random tiny model starts near zero digits
    and learns to emit them within minutes on CPU.

    Held-out split: `eval_size` distinct strings drawn from a fixed seed of their own; `sample` redraws any string
    of that set, so training never sees one (at 8 characters a redraw happens about once in 10^9 draws, so the
    training stream is the same as without a split).
    """

    def __init__(self, prompt_chars: int = 8, eval_size: int = 32) -> None:
        if prompt_chars < 1:
            raise ValueError(f"DigitsTask.prompt_chars must be >= 1, got {prompt_chars}")
        space = len(string.ascii_lowercase) ** prompt_chars
        if eval_size < 0 or eval_size > space // 2:
            raise ValueError(
                f"DigitsTask.eval_size must be between 0 and half of the {space} possible prompts of "
                f"{prompt_chars} characters, got {eval_size}"
            )
        self.prompt_chars = prompt_chars
        self.eval_size = eval_size
        self._held_out = self._draw_held_out()

    def _draw(self, rng: random.Random) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(self.prompt_chars))

    def _draw_held_out(self) -> tuple[str, ...]:
        # Its own seed: the split is the same in every run and never touches a training stream.
        rng = random.Random(f"grpo-digits-eval:{self.prompt_chars}")
        picked: dict[str, None] = {}
        while len(picked) < self.eval_size:
            picked.setdefault(self._draw(rng))
        return tuple(picked)

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        held_out = set(self._held_out)
        out = []
        for _ in range(n):
            text = self._draw(rng)
            while text in held_out:
                text = self._draw(rng)
            out.append(Prompt(text))
        return out

    def eval_prompts(self) -> list[Prompt]:
        if not self._held_out:
            raise ValueError("DigitsTask.eval_size=0: no held-out prompts; set data.task.eval_size > 0 or eval.enabled=false")
        return [Prompt(text) for text in self._held_out]

    def can_sample(self, prompt: Prompt) -> bool:
        text = prompt.text
        return (len(text) == self.prompt_chars and all(c in string.ascii_lowercase for c in text)
                and text not in self._held_out)


def gsm8k_final_answer(answer: str) -> str:
    """The number after GSM8K's '####' marker (commas removed); the whole string stripped when there is no marker."""
    final = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return final.strip().replace(",", "").replace("$", "")


class RowsTask(Task):
    """A task whose training prompts are `self.rows` of (text, answer), rendered by `self.render(text)` (which may
    use `self.tokenizer`): `can_sample` is whether a prompt renders as one of them."""

    rows: list[tuple[str, Optional[str]]]
    tokenizer: Any = None
    # (tokenizer, rendered training prompts) cached for can_sample; rebuilt when the tokenizer changes.
    _rendered_rows: Optional[tuple[Any, set[str]]] = None

    def render(self, text: str) -> str:
        raise NotImplementedError

    def can_sample(self, prompt: Prompt) -> bool:
        if self._rendered_rows is None or self._rendered_rows[0] is not self.tokenizer:
            self._rendered_rows = (self.tokenizer, {self.render(text) for text, _ in self.rows})
        return prompt.text in self._rendered_rows[1]


class GSM8KTask(RowsTask):
    """Grade-school math: rows of `{"question", "answer"}` in GSM8K's format ("... #### 42").

    `path` is a JSONL file, a directory written by `datasets`' `save_to_disk`, or a hub id (`openai/gsm8k`, with
    `subset: main`) loaded through `datasets` when the hub is reachable (offline, the error says how to save it and
    point `path` at the copy); `split` picks the split of a saved or hub data set. `path=None` uses the small offline
    set shipped with the package (written for this project, not GSM8K itself). With `chat_template=True` the question
    is rendered through the tokenizer's chat template (plain text when the tokenizer has none), after `system_prompt`
    (None: the template's own default).

    Held-out split (`eval_prompts`): the rows of `eval_path` (its `eval_split`; e.g. GSM8K's test split; an overlap
    with the training rows is an error), or else `eval_size` rows of `path` chosen by a hash of their question and
    removed from the rows `sample` draws. `eval_size=0` and no `eval_path`: no split, every row trains.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        chat_template: bool = True,
        eval_path: Optional[str] = None,
        eval_size: int = 0,
        system_prompt: Optional[str] = None,
        subset: Optional[str] = None,
        split: str = "train",
        eval_split: str = "test",
    ) -> None:
        self.path = str(Path(path).expanduser()) if path and Path(path).expanduser().exists() else (path or str(MINI_GSM8K))
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.subset = subset
        self.tokenizer: Any = None
        if eval_size < 0:
            raise ValueError(f"GSM8KTask.eval_size must be >= 0, got {eval_size}")
        # `rows` are what `sample` draws from; `eval_rows` the held-out split it never draws.
        self.rows, self.eval_rows = self._split(self._load(self.path, split), eval_path, eval_size, eval_split)

    def _split(
        self, rows: list[tuple[str, str]], eval_path: Optional[str], eval_size: int, eval_split: str
    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Held-out rows: those of `eval_path` (its first `eval_size` rows; 0 = all), else `eval_size` rows of
        `path` picked by a hash of their question (the same rows in every run) and removed from training."""
        if eval_path:
            held = self._load(eval_path, eval_split)
            held = held[:eval_size] if eval_size else held
            train_questions = {q for q, _ in rows}
            overlap = sum(q in train_questions for q, _ in held)
            if overlap:
                raise ValueError(
                    f"GSM8KTask: {overlap} of the {len(held)} eval questions in {eval_path} also appear in the "
                    f"training rows of {self.path}; use a disjoint eval set (e.g. GSM8K's test split)"
                )
            return rows, held
        if eval_size == 0:
            return rows, []
        if eval_size >= len(rows):
            raise ValueError(
                f"GSM8KTask.eval_size={eval_size} leaves no training rows of the {len(rows)} in {self.path}; "
                "lower it or give eval_path"
            )
        order = sorted(range(len(rows)), key=lambda i: hashlib.sha256(rows[i][0].encode()).hexdigest())
        held_idx = set(order[:eval_size])
        held = [rows[i] for i in sorted(held_idx)]
        held_questions = {q for q, _ in held}
        # A question repeated in the file stays on the held-out side in every copy.
        return [r for r in rows if r[0] not in held_questions], held

    def _load(self, source: str, split: str) -> list[tuple[str, str]]:
        if not Path(source).expanduser().exists() and source.endswith(".jsonl"):
            raise FileNotFoundError(f"GSM8KTask: no JSONL file at {source} (expected rows of {{question, answer}})")
        rows = []
        for where, row in load_rows(source, split, self.subset, who="GSM8KTask"):
            try:
                question, answer = str(row["question"]), str(row["answer"])
            except KeyError as e:
                raise ValueError(f"GSM8KTask: {where} is not a {{question, answer}} row ({e})") from e
            final = gsm8k_final_answer(answer)
            if not re.fullmatch(r"-?\d+(\.\d+)?", final):
                raise ValueError(f"GSM8KTask: {where} has no numeric final answer after '####': {answer!r}")
            rows.append((question, final))
        if not rows:
            raise ValueError(f"GSM8KTask: {source} holds no rows")
        return rows

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, question: str) -> str:
        content = f"{GSM8K_INSTRUCTION}\n\n{question}"
        if self.chat_template and self.tokenizer is not None:
            return render_chat(self.tokenizer, content, self.system_prompt)
        return f"{content}\n\nAnswer:"

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        picks = [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]
        return [Prompt(self.render(q), a) for q, a in picks]

    def eval_prompts(self) -> list[Prompt]:
        if not self.eval_rows:
            raise ValueError(
                f"GSM8KTask has no held-out rows (eval_size=0, no eval_path): set data.task.eval_size (a split of "
                f"{self.path}) or data.task.eval_path (a test file), or eval.enabled=false"
            )
        return [Prompt(self.render(q), a) for q, a in self.eval_rows]

"""Prompts from a file the user already has: JSONL, parquet, or a Hugging Face dataset saved with `save_to_disk`.

`PromptFileTask` is the task of `data=prompt_file` (conf/data/prompt_file.yaml); docs/own_task.md shows it with
a reward function from the user's own module.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

from grpo.config_values import CheckContext, ConfigError
from grpo.tasks.hf_datasets import read_jsonl
from grpo.tasks.prompts import Prompt, RowsTask

FORMATS = ("auto", "jsonl", "parquet", "hf_disk")


def detect_format(path: Path) -> str:
    """jsonl for .jsonl/.json files, parquet for .parquet, hf_disk for a directory written by `save_to_disk`."""
    if path.is_dir():
        return "hf_disk"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(
        f"PromptFileTask: cannot tell the format of {path} from its name; set data.task.format to one of "
        f"{', '.join(FORMATS[1:])}"
    )


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"PromptFileTask: reading {path} needs pyarrow: pip install pyarrow") from e
    return pq.read_table(path).to_pylist()


def _read_hf_disk(path: Path, split: Optional[str]) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"PromptFileTask: reading {path} needs Hugging Face datasets: pip install datasets") from e
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None or split not in loaded:
            raise ValueError(
                f"PromptFileTask: {path} holds the splits {sorted(loaded)}; choose one with data.task.split"
                + ("" if split is None else f" (no split {split!r})")
            )
        loaded = loaded[split]
    elif split is not None:
        raise ValueError(f"PromptFileTask: {path} is a single dataset without splits; set data.task.split=null")
    return loaded.to_list()


def read_rows(path: Path, fmt: str = "auto", split: Optional[str] = None) -> list[dict[str, Any]]:
    """Every row of `path` as a dict, in file order."""
    if fmt not in FORMATS:
        raise ValueError(f"PromptFileTask: format={fmt!r} is not one of {', '.join(FORMATS)}")
    if not path.exists():
        raise FileNotFoundError(f"PromptFileTask: no file or directory at {path} (relative paths start at {Path.cwd()})")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if split is not None and fmt != "hf_disk":
        raise ValueError(f"PromptFileTask: split={split!r} applies to a saved Hugging Face dataset, not a {fmt} file")
    if fmt == "jsonl":
        return [row for _, row in read_jsonl(path, "PromptFileTask")]
    if fmt == "parquet":
        return _read_parquet(path)
    return _read_hf_disk(path, split)


def rows_to_prompts(rows: list[dict[str, Any]], source: str, prompt_column: str,
                    answer_column: Optional[str]) -> list[tuple[str, Optional[str]]]:
    """(prompt, answer) pairs; a clear error names a missing column and the columns the data has."""
    if not rows:
        raise ValueError(f"PromptFileTask: {source} holds no rows")
    pairs = []
    for i, row in enumerate(rows):
        for key, column in (("prompt_column", prompt_column), ("answer_column", answer_column)):
            if column is not None and column not in row:
                raise KeyError(
                    f"PromptFileTask: row {i} of {source} has no column {column!r} (data.task.{key}); "
                    f"its columns are {sorted(row)}"
                )
        text = row[prompt_column]
        if not isinstance(text, str) or not text:
            raise ValueError(f"PromptFileTask: row {i} of {source}: {prompt_column!r} must be a non-empty string, got {text!r}")
        answer = None if answer_column is None else row[answer_column]
        pairs.append((text, None if answer is None else answer if isinstance(answer, str) else json.dumps(answer)))
    return pairs


class PromptFileTask(RowsTask):
    """Prompts (and optional reference answers) read from a JSONL file, a parquet file or a saved HF dataset.

    Each prompt is rendered with `template` (`{prompt}` is replaced by the prompt column; `\\n` and `\\t` written as
    two characters, as the command line gives them, are a newline and a tab), then through the
    tokenizer's chat template when `chat_template` is true. `sample` draws rows uniformly with replacement from the
    seeded `rng` the pipeline gives it, so a resumed run sees the same prompts. Held-out prompts for evaluation come
    from `eval_path` (another file) or `eval_split` (another split of a saved dataset dict at `path`).
    """

    def __init__(
        self,
        path: str,
        prompt_column: str = "prompt",
        answer_column: Optional[str] = None,
        format: str = "auto",  # noqa: A002 - the config key users write
        split: Optional[str] = None,
        template: str = "{prompt}",
        chat_template: bool = False,
        eval_path: Optional[str] = None,
        eval_split: Optional[str] = None,
    ) -> None:
        if "{prompt}" not in template:
            raise ValueError(f"PromptFileTask: template must contain '{{prompt}}', got {template!r}")
        # Hydra's command line keeps `\n` and `\t` as two characters (a YAML "..." string turns them into the
        # character): data.task.template='"Question: {prompt}\nAnswer:"' would put a backslash and an n in every prompt.
        template = template.replace("\\n", "\n").replace("\\t", "\t")
        self.path = Path(path).expanduser()
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.format, self.template, self.chat_template = format, template, chat_template
        self.tokenizer: Any = None
        self.rows = self._load(self.path, split)
        # Read at start-up too, so a wrong held-out path fails before training, not at the first evaluation.
        self.eval_rows: Optional[list[tuple[str, Optional[str]]]] = None
        if eval_path is not None or eval_split is not None:
            self.eval_rows = self._load(Path(eval_path).expanduser() if eval_path else self.path, eval_split)

    @classmethod
    def check_config(cls, cfg: Any, ctx: CheckContext) -> None:
        """Its prompt files (`path`, `eval_path`) exist: said with their exact key before anything is built. Found
        while building the task, the message named only `data.task`, after the start-up log had named a run dir that
        was then discarded."""
        node, key = ctx.node(cfg), ctx.key
        for name in ("path", "eval_path"):
            given = node.get(name)
            if given is not None and not Path(str(given)).expanduser().exists():
                raise ConfigError(f"{key}.{name}={given}: no file or directory there (relative paths start at "
                                  f"{Path.cwd()}); set {key}.{name} to your prompts' file or directory")

    def _load(self, path: Path, split: Optional[str]) -> list[tuple[str, Optional[str]]]:
        source = f"{path}" + (f" (split {split})" if split else "")
        return rows_to_prompts(read_rows(path, self.format, split), source, self.prompt_column, self.answer_column)

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, text: str) -> str:
        """The text the model continues for prompt column value `text`."""
        content = self.template.replace("{prompt}", text)
        if self.chat_template and self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        return content

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        picks = [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]
        return [Prompt(self.render(text), answer) for text, answer in picks]

    def eval_prompts(self) -> list[Prompt]:
        """Every held-out prompt, in file order (from `eval_path` / `eval_split`)."""
        if self.eval_rows is None:
            raise ValueError(
                "PromptFileTask has no held-out prompts: set data.task.eval_path (a file) or data.task.eval_split "
                "(a split of the dataset at data.task.path), or run without evaluation: eval.enabled=false"
            )
        return [Prompt(self.render(text), answer) for text, answer in self.eval_rows]

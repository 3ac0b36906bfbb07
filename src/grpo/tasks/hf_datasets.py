"""Rows of a data set from wherever a user keeps it: a JSONL file, a directory written by `datasets`' `save_to_disk`,
or a Hugging Face hub id (`openai/gsm8k`) loaded through `datasets` when the hub is reachable.

Offline (no hub, as on this project's machines), a hub id fails at once with what to do instead: save the data set
where the hub is reachable and point the task at the saved directory or a JSONL file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional


def read_jsonl(path: Path, who: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSONL file; ValueError naming `who`, the file and the line
    when a line is not a JSON object."""
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{who}: {path}:{lineno} is not a JSON object ({e})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{who}: {path}:{lineno} is a JSON {type(row).__name__}, not an object")
        rows.append((lineno, row))
    return rows


class DatasetUnavailable(ValueError):
    """The rows could not be read; the message says where it looked and what to do."""


def offline_advice(hub_id: str, subset: Optional[str]) -> str:
    """How to get a hub data set onto a machine without the hub."""
    args = f"'{hub_id}'" + (f", '{subset}'" if subset else "")
    return (f"on a machine that reaches the hub run: python -c \"from datasets import load_dataset; "
            f"load_dataset({args}).save_to_disk('{hub_id.split('/')[-1]}')\", copy that directory here and set the "
            f"task's path to it (or to a JSONL file of its rows)")


def looks_like_hub_id(source: str) -> bool:
    """`owner/name` with no file-system meaning (not absolute, not ./ or ~, no extension, not on disk)."""
    parts = source.split("/")
    return (len(parts) == 2 and all(parts) and not source.startswith((".", "~")) and "." not in parts[1][-6:]
            and not Path(source).exists())


def load_rows(source: str, split: str, subset: Optional[str] = None, who: str = "task") -> list[tuple[str, dict]]:
    """(where, row) of every row of `source`'s `split`: `where` names the row in errors (file:line or split:index).

    `source` is a JSONL file (`split` unused), a `save_to_disk` directory (a DatasetDict: its `split`; a Dataset: all
    of it) or a hub id (`datasets.load_dataset(source, subset, split=split)`)."""
    path = Path(source).expanduser()
    if path.is_file():
        return [(f"{path}:{lineno}", row) for lineno, row in read_jsonl(path, who)]
    if path.is_dir():
        return _saved_rows(path, split, who)
    if looks_like_hub_id(source):
        return _hub_rows(source, subset, split, who)
    raise DatasetUnavailable(f"{who}: {source} is neither a file, a saved data set directory nor a hub id "
                             "(owner/name)")


def _saved_rows(path: Path, split: str, who: str) -> list[tuple[str, dict]]:
    from datasets import DatasetDict, load_from_disk

    try:
        data: Any = load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DatasetUnavailable(f"{who}: {path} is a directory but not one written by datasets' save_to_disk ({e})") \
            from None
    if isinstance(data, DatasetDict):
        if split not in data:
            raise DatasetUnavailable(f"{who}: the data set saved in {path} has no split {split!r} (it has "
                                     f"{', '.join(data)})")
        data = data[split]
    return [(f"{path}[{split}]:{i}", dict(row)) for i, row in enumerate(data)]


def _hub_rows(hub_id: str, subset: Optional[str], split: str, who: str) -> list[tuple[str, dict]]:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise DatasetUnavailable(f"{who}: {hub_id} is a hub id and the hub is switched off here (HF_HUB_OFFLINE / "
                                 f"HF_DATASETS_OFFLINE=1); {offline_advice(hub_id, subset)}")
    from datasets import load_dataset

    try:
        data = load_dataset(hub_id, subset, split=split)
    except Exception as e:  # noqa: BLE001 (datasets raises connection, HTTP and not-found errors of many types)
        raise DatasetUnavailable(f"{who}: could not load {hub_id} ({subset or 'default'}, split {split}) from the hub: "
                                 f"{type(e).__name__}: {str(e)[:200]}; {offline_advice(hub_id, subset)}") from None
    return [(f"{hub_id}[{split}]:{i}", dict(row)) for i, row in enumerate(data)]

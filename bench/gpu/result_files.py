"""A plan's raw results, read plain or gzip-compressed. The larger files (each run's metrics.jsonl) are committed as
``<name>.gz``: the checkout travels with every device call, and the kit's vLLM parts need most of a call's 64 MiB
(scripts/device/split-wheel refuses a checkout that leaves them under 8 MiB)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def compressed(path: Path) -> Path:
    """Where the compressed copy of `path` is committed: `<path>.gz`."""
    return path.with_name(path.name + ".gz")


def read_text(path: Path) -> str:
    """The text of `path`, or of `<path>.gz` where only the compressed copy is there."""
    if not path.exists() and compressed(path).exists():
        return gzip.decompress(compressed(path).read_bytes()).decode()
    return path.read_text()


def read_rows(path: Path) -> list[dict]:
    """The JSON rows of a metrics.jsonl (plain or `.gz`), blank lines left out."""
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def exists(path: Path) -> bool:
    """Whether `path` or its compressed copy `<path>.gz` is there."""
    return path.exists() or compressed(path).exists()


def find(folder: Path, pattern: str) -> list[Path]:
    """The files of `folder` matching `pattern`, a compressed one named without its `.gz` (`read_text` reads it)."""
    names = set(folder.glob(pattern)) | {p.with_name(p.name[: -len(".gz")]) for p in folder.glob(pattern + ".gz")}
    return sorted(names)


def compress_large(folder: Path, min_bytes: int = 300_000) -> list[Path]:
    """Replace each `*.jsonl` of `folder` (recursively) of at least `min_bytes` by its `.gz`; the paths replaced."""
    done = []
    for path in sorted(folder.rglob("*.jsonl")):
        if path.stat().st_size >= min_bytes:
            compressed(path).write_bytes(gzip.compress(path.read_bytes(), compresslevel=9, mtime=0))
            path.unlink()
            done.append(path)
    return done


if __name__ == "__main__":
    import sys

    for folder in sys.argv[1:] or ["bench/results"]:
        for path in compress_large(Path(folder)):
            print(f"compressed {path}")

"""What the server's log says: its last lines, and what a start-up is busy with (vLLM's latest message)."""

from __future__ import annotations

import os
from pathlib import Path


def shorten_balanced(text: str, limit: int) -> str:
    """`text`, cut to about `limit` characters with "..." where cut, and its brackets closed: quoted in a progress
    line's own brackets, a cut message read as "(grpo: ... (vLLM's AOT cache ... does)" with one left open."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 3] + "..."
    return cut + ")" * max(0, cut.count("(") - cut.count(")"))


def log_tail(log_path: Path, n: int = 40) -> str:
    """Last `n` lines of the server log at `log_path`."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(lines[-n:])


def start_up_phase(log_path: Path) -> str:
    """` (<vLLM's last log message>)`, shortened, or "" when the log has none yet: what a start-up is busy with."""
    if not log_path.exists():
        return ""
    for line in reversed(log_tail(log_path, 5).splitlines()):
        # vLLM's lines read "(EngineCore pid=1) INFO 11-25 07:34:25 [file.py:12] message": keep the message.
        message = line.split("] ", 1)[-1].strip()
        if message and not message.startswith("====="):
            return f" ({shorten_balanced(message, 100)})"
    return ""

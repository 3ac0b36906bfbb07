"""Where a run's wall clock went, from the process's start to its summary: start-up (to the training loop's start:
the server's start or the wait for it, the model's load, the rest), then the loop's parts (generation waited on,
training, evaluation waited on, weight syncs, checkpoints), then the teardown; and when the server was launched and
ready, which overlap the start-up's parts. summary.json's `wall_clock` and the run's last line."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

# When this module was imported: the process's start where /proc cannot say (the trainer imports it at start-up).
_IMPORTED_AT = time.time()
# Whether a clock has claimed the process's start: a multirun's later jobs start at their own job start.
_process_start_claimed = False

# The training loop's parts, in the order the summary lists them.
LOOP_PARTS = ("generation_wait", "training", "eval_wait", "sync", "checkpoint")


def process_start_time() -> float:
    """This process's start (seconds since the epoch) from /proc (Linux); the import of this module elsewhere."""
    try:
        stat = Path("/proc/self/stat").read_text()
        # Fields after the command's closing parenthesis start at field 3; field 22 is the start in clock ticks
        # after boot.
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


class WallClock:
    """Seconds of one job by part; see the module docstring. `origin`: where its clock starts (default: the
    process's start for the process's first job, the job's start for a multirun's later ones)."""

    def __init__(self, origin: Optional[float] = None) -> None:
        global _process_start_claimed
        self.job_start = time.time()
        if origin is None:
            origin = self.job_start if _process_start_claimed else min(process_start_time(), self.job_start)
            _process_start_claimed = True
        self.origin = origin
        self.startup: dict[str, float] = {}
        # When named moments of the start-up happened (time.time()), in their order: `imported`, `server_launched`,
        # `parts_built` (config, tokenizer, sync, data and evaluator objects), `server_ready`, `model_loaded`,
        # `optimizer_built`, `data_ready` (the data source set up on the server); the loop's start (`startup_seconds`)
        # ends the start-up.
        self.marks: dict[str, float] = {}
        self.parts = dict.fromkeys(LOOP_PARTS, 0.0)
        self.loop_start: Optional[float] = None
        self.loop_end: Optional[float] = None

    def add_startup(self, part: str, seconds: float) -> None:
        """A named part of the start-up (`server_start`, `model_load`)."""
        self.startup[part] = self.startup.get(part, 0.0) + seconds

    def mark(self, event: str, at: Optional[float] = None) -> None:
        """Note that `event` (one of the moments above) happened `at` (time.time(); default now);
        the summary gives it in seconds from the clock's origin. Its first note counts; one before the origin (the
        process's imports, for a sweep's later job) is none of this job's."""
        at = time.time() if at is None else at
        if at >= self.origin:
            self.marks.setdefault(event, at)

    def add(self, part: str, seconds: float) -> None:
        """Seconds of one of the loop's parts (LOOP_PARTS)."""
        self.parts[part] += seconds

    def loop_started(self) -> None:
        """The training loop begins (its first rollout request, or the evaluation of the initial weights first)."""
        self.loop_start = time.time()

    def loop_ended(self) -> None:
        self.loop_end = time.time()

    def summary(self, now: Optional[float] = None) -> dict[str, float | dict[str, float]]:
        """The breakdown at `now` (default: now): every part in seconds; `other_seconds` is the loop's time in none
        of them (writing rows, health checks), so the top-level parts add up to `since_process_start_seconds`."""
        now = time.time() if now is None else now
        loop_start = self.loop_start if self.loop_start is not None else now
        loop_end = self.loop_end if self.loop_end is not None else now
        startup = loop_start - self.origin
        named = {f"{k}_seconds": v for k, v in self.startup.items()}
        startup_parts = {"before_job_seconds": self.job_start - self.origin, **named}
        startup_parts["other_seconds"] = startup - sum(startup_parts.values())
        loop = {f"{k}_seconds": v for k, v in self.parts.items()}
        teardown = now - loop_end
        return {
            "since_process_start_seconds": now - self.origin,
            "startup_seconds": startup,
            "startup": startup_parts,
            # Moments, not parts: seconds from the origin to each (the server starts beside the start-up's parts).
            "startup_at": {f"{k}_seconds": v - self.origin for k, v in self.marks.items()},
            **loop,
            "teardown_seconds": teardown,
            "other_seconds": (loop_end - loop_start) - sum(loop.values()),
        }


def describe(wall_clock: dict) -> str:
    """One line of a summary's `wall_clock`: the total and each part's seconds (start-up's own parts in brackets)."""
    startup = wall_clock["startup"]
    inner = ", ".join(f"{k.removesuffix('_seconds').replace('_', ' ')} {v:.0f} s" for k, v in startup.items() if v >= 0.5)
    at = wall_clock.get("startup_at") or {}
    moments = {"imported_seconds": "imports done at", "server_launched_seconds": "vLLM launched at",
               "server_ready_seconds": "ready at"}
    inner += "".join(f"; {label} {at[k]:.0f} s" for k, label in moments.items() if k in at)
    parts = [f"start-up {wall_clock['startup_seconds']:.0f} s ({inner})"]
    labels = {"generation_wait": "generation waited on", "training": "training", "eval_wait": "evaluation waited on",
              "sync": "sync", "checkpoint": "checkpoints"}
    parts += [f"{label} {wall_clock[f'{k}_seconds']:.0f} s" for k, label in labels.items()]
    parts += [f"teardown {wall_clock['teardown_seconds']:.0f} s", f"other {wall_clock['other_seconds']:.0f} s"]
    return f"wall clock {wall_clock['since_process_start_seconds']:.0f} s from process start: " + ", ".join(parts)

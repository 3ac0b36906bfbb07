"""Sweep report: one row per job of a multirun dir, and a PNG comparing reward curves; given one run dir, its row.

    python -m grpo.report multirun/2026-11-21/12-00-00        (or: grpo-report <dir>)
    python -m grpo.report outputs/2026-11-21/12-00-00_arith_quick     # one run (a resumed one: the whole run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from grpo.run_summary import reward_window
from grpo.trainer.metrics import MetricsFileError, read_metrics

COLUMNS = ("job", "overrides", "status", "steps", "last10_reward_mean", "best_reward", "final_loss", "steps_per_s",
           "clip_fraction", "eval_first", "eval_best", "eval_last")
# The held-out metric of the eval columns (first evaluation, best, last).
EVAL_KEY = "eval/accuracy"


def _overrides(job_dir: Path) -> str:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return ""
    from omegaconf import OmegaConf

    return " ".join(str(o) for o in OmegaConf.load(path))


def _read_job_files(job_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(summary.json, metrics rows, what could not be read) of a job dir. A file torn by a crash or a full disk (a
    summary.json cut short; a bad metrics line before the last) makes that job's row say so instead of failing the
    report of every other job."""
    summary: Any = {}
    rows: list[dict[str, Any]] = []
    unreadable = []
    path = job_dir / "summary.json"
    if path.exists():
        try:
            summary = json.loads(path.read_text())
        except ValueError as e:
            summary = {}
            unreadable.append(f"{path}: {e}")
        if not isinstance(summary, dict):
            unreadable.append(f"{path}: not a JSON object")
            summary = {}
    path = job_dir / "metrics.jsonl"
    if path.exists():
        try:
            rows = read_metrics(path)
        except MetricsFileError as e:
            unreadable.append(str(e))
    return summary, rows, unreadable


def job_row(job_dir: Path) -> dict[str, Any]:
    """Summary of one job dir (status from summary.json; figures from metrics.jsonl). A file it cannot read makes
    the status `unreadable` (the reason is printed to stderr)."""
    summary, rows, unreadable = _read_job_files(job_dir)
    for problem in unreadable:
        print(f"grpo.report: cannot read {problem}", file=sys.stderr)
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    step_s = [r["time/step_seconds"] for r in rows if r.get("time/step_seconds")]
    tail = rewards[-reward_window(len(rewards)):]
    evals = [r[EVAL_KEY] for r in rows if r.get(EVAL_KEY) is not None]
    clipped = [r["grpo/clipped_fraction"] for r in rows if r.get("grpo/clipped_fraction") is not None]
    return {
        "job": job_dir.name,
        "overrides": _overrides(job_dir),
        "status": "unreadable" if unreadable else summary.get("status", "running" if rows else "not started"),
        # The largest: an evaluation beside training writes its row (of an earlier step) after later steps' rows.
        "steps": max(r["step"] for r in rows) if rows else 0,
        "last10_reward_mean": sum(tail) / len(tail) if tail else None,
        "best_reward": max(rewards) if rewards else None,
        "final_loss": losses[-1] if losses else None,
        "steps_per_s": len(step_s) / sum(step_s) if step_s else None,
        # Mean share of loss tokens whose ratio the clip bound, over every optimizer step.
        "clip_fraction": sum(clipped) / len(clipped) if clipped else None,
        "eval_first": evals[0] if evals else None,
        "eval_best": max(evals) if evals else None,
        "eval_last": evals[-1] if evals else None,
        "_rewards": [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None],
        "_loop_seconds": loop_seconds(summary.get("wall_clock")),
    }


def loop_seconds(wall_clock: Any) -> float | None:
    """The seconds of a job's training loop (its wall clock less its start-up and teardown: generation, training,
    evaluation, syncs, checkpoints), from summary.json's `wall_clock`; None without one."""
    if not isinstance(wall_clock, dict):
        return None
    try:
        return float(wall_clock["since_process_start_seconds"] - wall_clock["startup_seconds"]
                     - wall_clock["teardown_seconds"])
    except (KeyError, TypeError):
        return None


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job sub-directories of a sweep, in job order; a single run's dir is its own one job."""
    dirs = [d for d in sweep_dir.iterdir() if d.is_dir() and (d / ".hydra").exists()]
    if not dirs and (sweep_dir / "metrics.jsonl").exists():
        return [sweep_dir]
    return sorted(dirs, key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table of the report rows."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def plot_rewards(rows: list[dict[str, Any]], out: Path) -> Path:
    """One reward curve per job on shared axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        if r["_rewards"]:
            steps, rewards = zip(*r["_rewards"])
            ax.plot(steps, rewards, label=f"{r['job']}: {r['overrides']}"[:60], lw=1.4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward/mean")
    ax.grid(alpha=0.3)
    if any(r["_rewards"] for r in rows):  # a sweep whose jobs were all skipped has no curve to label
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report(sweep_dir: Path) -> tuple[str, list[dict[str, Any]]]:
    """Build the table, write report.json and rewards.png into the sweep dir; returns (table, rows)."""
    rows = [job_row(d) for d in job_dirs(sweep_dir)]
    table = format_table(rows)
    (sweep_dir / "report.json").write_text(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], indent=2))
    plot_rewards(rows, sweep_dir / "rewards.png")
    return table, rows


def sweep_done_message(sweep_dir: Path, wall_seconds: float | None = None) -> str:
    """The lines a sweep (`python train.py -m ...`) ends with: its jobs by status, where they are, the command that
    compares them (each job's own last line names only that job's dir), and last its wall clock (`wall_seconds`)
    against the jobs' training loops summed (`loop_seconds`; what is not in them went to start-ups, teardowns and
    waits between jobs)."""
    rows = [job_row(d) for d in job_dirs(sweep_dir)] if sweep_dir.is_dir() else []
    counts = Counter(r["status"] for r in rows)
    statuses = ", ".join(f"{n} {status}" for status, n in counts.most_common())
    jobs = f"{len(rows)} job{'s' if len(rows) != 1 else ''}" + (f" ({statuses})" if statuses else "")
    lines = [f"sweep done: {jobs} in {sweep_dir}", f"  compare them: python -m grpo.report {sweep_dir}"]
    if wall_seconds is not None:
        loops = [r["_loop_seconds"] for r in rows if r["_loop_seconds"] is not None]
        lines.append(f"  wall clock {wall_seconds:.0f} s; training {sum(loops):.0f} s summed over the {len(loops)} "
                     f"job{'s' if len(loops) != 1 else ''} that ran (their training loops, without start-up and "
                     "teardown)")
    return "\n".join(lines)


class SweepDone(Callback):
    """Hydra callback (conf/train.yaml, hydra.callbacks): after the last job of a sweep, print `sweep_done_message`
    with the sweep's wall clock from its start."""

    def __init__(self) -> None:
        self.started: float | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:  # noqa: ARG002
        self.started = time.monotonic()

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:  # noqa: ARG002
        wall = time.monotonic() - self.started if self.started is not None else None
        print(sweep_done_message(Path(str(config.hydra.sweep.dir)), wall), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="grpo-report", description="Summarise a multirun sweep dir, or one run dir.")
    parser.add_argument("dir", type=Path, help="a sweep (multirun) dir, or one run dir")
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        parser.error(f"{args.dir} is not a directory: give a run dir or a sweep (multirun) dir")
    if not job_dirs(args.dir):
        parser.error(f"no runs in {args.dir}: a run dir has a metrics.jsonl, a sweep dir has job dirs "
                     "(0, 1, ...) with a .hydra/ each")
    table, _ = report(args.dir)
    print(table)
    print(f"\nwrote {args.dir / 'report.json'} and {args.dir / 'rewards.png'}")


if __name__ == "__main__":
    main()

"""How a run ended, in its run dir and on the terminal: summary.json (status, steps, the first and last reward means,
where the wall clock went), the one line a completed run ends with, and the value a sweep optimises
(`train.objective`: a metrics key, checked at start-up, or the last reward mean)."""

from __future__ import annotations

import difflib
import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Sequence

from grpo.config_values import ConfigError
from grpo.trainer.metrics import read_metrics
from grpo.trainer.wall_clock import WallClock, describe

log = logging.getLogger(__name__)

# Rollout batches averaged for `first10_reward_mean` and `last10_reward_mean` (the objective sweeps optimise); a run
# of fewer than two windows averages half of its batches each (`reward_window`), so the two never overlap.
REWARD_WINDOW = 10


def reward_window(batches: int) -> int:
    """Rollout batches in each of the first and last reward means: REWARD_WINDOW, or half the run's batches when
    that is fewer (at least 1): with 15 batches (sweep=clip_eps) the first and last 10 shared 5, which read as less
    learning than there was."""
    return max(1, min(REWARD_WINDOW, batches // 2))


def steps_in(rows: Sequence[dict], default: int) -> int:
    """The last optimizer step of metrics rows (not rollout batches: with train.ppo_epochs x train.mini_batches > 1
    a batch has several); `default` when no row has one."""
    return max((int(r["step"]) for r in rows if r.get("step") is not None), default=default)


def earlier_wall_seconds(resumed: Path) -> float:
    """The wall-clock seconds of every session of the run a resume continues, from its summary.json (its
    `run_wall_seconds`, or `wall_seconds` of a summary that predates it); 0 when it has none (a session killed
    before writing one)."""
    try:
        summary = json.loads((resumed / "summary.json").read_text())
        return float(summary.get("run_wall_seconds", summary.get("wall_seconds")) or 0.0)
    except FileNotFoundError:
        return 0.0
    except (OSError, ValueError, TypeError, AttributeError) as e:
        log.warning("earlier sessions' wall time not counted: %s unreadable (%s)", resumed / "summary.json", e)
        return 0.0


class RunSummary:
    """Writes summary.json when a run ends, however it ends: `wall_seconds` is this session's wall-clock time,
    `run_wall_seconds` the whole run's (the earlier sessions' of a resumed run, `resumed` its run dir, added)."""

    def __init__(self, run_dir: Path, resumed: Path | None = None) -> None:
        self.path = run_dir / "summary.json"
        self.t0 = time.time()
        # Read now: a resume in place writes this session's summary over the earlier one.
        self.earlier_seconds = earlier_wall_seconds(resumed) if resumed is not None else 0.0

    def _write(self, data: dict) -> None:
        """Replace summary.json whole (a crash never leaves half of it); a failed write is logged, not raised: it
        runs inside the error handling of a failed run, whose own error must stay the one reported."""
        data["wall_seconds"] = time.time() - self.t0
        data["run_wall_seconds"] = self.earlier_seconds + data["wall_seconds"]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=2))
            os.replace(tmp, self.path)
        except OSError as e:
            log.error("could not write %s (status %s): %s", self.path, data.get("status"), e)

    def finish(self, rewards: list[float], wall_clock: WallClock | None = None) -> float | None:
        """Record a completed run; returns the mean reward of the last REWARD_WINDOW rollout batches.

        A run resumed in its own run dir counts every step of its metrics.jsonl, not only this session's `rewards`.
        `wall_clock`: where this session's wall clock went (summary.json's `wall_clock`, from the process's start).
        """
        rows = self._metric_rows()
        rewards = [float(r["reward/mean"]) for r in rows if r.get("reward/mean") is not None] or rewards
        steps = steps_in(rows, default=len(rewards))
        window = reward_window(len(rewards))
        last = sum(rewards[-window:]) / len(rewards[-window:]) if rewards else None
        first = sum(rewards[:window]) / len(rewards[:window]) if rewards else None
        data = {"status": "completed", "steps_run": steps, "rollout_batches": len(rewards),
                "last10_reward_mean": last, "first10_reward_mean": first, "reward_window": window,
                "best_reward": max(rewards) if rewards else None}
        if wall_clock is not None:
            data["wall_clock"] = wall_clock.summary()
        self._write(data)
        return last

    def _metric_rows(self) -> list[dict]:
        path = self.path.with_name("metrics.jsonl")
        return read_metrics(path) if path.exists() else []

    def skip(self, error: BaseException) -> None:
        """Record a sweep job skipped at start-up for its config (`grpo.report` shows it as skipped, with why). In a
        dir whose metrics.jsonl has rows, summary.json is another run's (the job was refused for holding it): kept."""
        metrics = self.path.with_name("metrics.jsonl")
        if metrics.exists() and metrics.stat().st_size > 0:
            return
        self._write({"status": "skipped", "error": f"{type(error).__name__}: {error}"})

    def fail(self, error: BaseException, wall_clock: WallClock | None = None) -> None:
        """Record a failed or interrupted run, with the steps its metrics.jsonl holds (0 before the first; None when
        that file cannot be read: the run's own error stays the one reported) and where its wall clock went."""
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        try:
            steps: int | None = steps_in(self._metric_rows(), default=0)
        except (OSError, ValueError) as e:  # MetricsFileError is a ValueError
            log.error("steps_run of %s unknown: %s", self.path, e)
            steps = None
        data = {"status": status, "steps_run": steps, "error": f"{type(error).__name__}: {error}",
                "traceback": "".join(traceback.format_exception(error))[-4000:]}
        if wall_clock is not None:
            data["wall_clock"] = wall_clock.summary()
        self._write(data)


def done_message(run_dir: Path) -> str:
    """The one line a completed run ends with: steps, reward and held-out accuracy from first to last, and where the
    outputs are (the run dir is otherwise named only among the start-up lines)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    parts = [f"run completed: {summary['steps_run']} steps"]
    first, last = summary.get("first10_reward_mean"), summary.get("last10_reward_mean")
    batches = summary.get("rollout_batches") or 0
    window = summary.get("reward_window") or reward_window(batches)
    if last is not None and batches < 2:
        # One batch is both the first and the last: "0.541 -> 0.541" read as no learning.
        parts.append(f"reward {last:.3f} (mean of its {batches} rollout batch{'es' if batches != 1 else ''})")
    elif last is not None:
        parts.append(f"reward {first:.3f} -> {last:.3f} (mean of the first and last {window} rollout "
                     f"batch{'es' if window != 1 else ''} of {batches})")
    # By step: evaluations beside training write their rows when they complete.
    evals = sorted((r for r in rows if r.get("eval/accuracy") is not None), key=lambda r: r["step"])
    if len(evals) > 1:
        parts.append(f"held-out accuracy {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f}")
    elif evals:  # "0.382 -> 0.382" read as no learning when only the step-0 eval ran (eval.at_end=false)
        parts.append(f"held-out accuracy {evals[0]['eval/accuracy']:.3f} (one evaluation, at step {evals[0]['step']})")
    # Where the wall clock went on a line of its own, then one line, the run's last (README): steps, reward, held-out
    # accuracy and the run dir.
    clock = f"{describe(summary['wall_clock'])}\n" if summary.get("wall_clock") else ""
    return clock + "; ".join([*parts, f"run dir: {run_dir} (summary: python -m grpo.report {run_dir})"])


# The metrics keys without a `<group>/` prefix (every other key has one: reward/mean, grpo/kl, eval/accuracy, ...).
PLAIN_METRIC_KEYS = ("loss", "grad_norm", "lr", "step", "batch", "epoch")
# summary.json's figures, which are not metrics keys; the default objective (null) is the first.
SUMMARY_FIGURES = ("last10_reward_mean", "first10_reward_mean", "best_reward")


def check_objective(key: str | None, eval_enabled: bool, eval_metrics: Sequence[str] = ()) -> None:
    """Start-up check of `train.objective`: an `eval/` key needs the evaluator on and must be one it logs, and a key
    without a `<group>/` prefix must be one of the few plain ones (a typo, or summary.json's last10_reward_mean,
    would otherwise surface only after the whole run, when the objective is read)."""
    if key is not None and "/" not in key and key not in PLAIN_METRIC_KEYS:
        hint = (f"{key} is a figure of summary.json, not a metrics key; the default train.objective=null is "
                "last10_reward_mean" if key in SUMMARY_FIGURES else
                f"metrics keys are {', '.join(PLAIN_METRIC_KEYS)} or <group>/<name> (reward/mean, eval/accuracy, ...)")
        raise ConfigError(f"train.objective={key} is not a metrics key: {hint}")
    if key is None or not key.startswith("eval/"):
        return
    if not eval_enabled:
        raise ConfigError(f"train.objective={key} is an eval metric but eval is off; set eval.enabled=true "
                          "(and eval.task for data=atropos) or train.objective=null")
    if eval_metrics and key not in eval_metrics:
        close = difflib.get_close_matches(key, eval_metrics, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"train.objective={key} is not a metric the evaluator logs; {hint}(it logs "
                          f"{', '.join(eval_metrics)})")


def objective_value(run_dir: Path, key: str | None, final_reward: float | None) -> float | None:
    """What train.py returns: the last-10 mean reward when `key` is None, else the last logged value of `key`."""
    if key is None:
        return final_reward
    rows = read_metrics(run_dir / "metrics.jsonl")
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        logged = sorted({k for r in rows for k in r})
        close = difflib.get_close_matches(key, logged, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"train.objective={key}: no row of {run_dir / 'metrics.jsonl'} has this key (the run "
                          f"itself completed){hint}")
    return float(values[-1])

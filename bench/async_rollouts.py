"""Asynchronous rollouts (issue 18): `train.max_staleness` = 0 vs 1 on the default job (tiny Qwen2, digits task,
its own vLLM CPU server, 8 prompts x 8 completions per step), eval off. Each k is one `train.py` process; the
steady-state rate is taken over steps 3..N from metrics.jsonl (the sum of `time/step_seconds`, which covers fetch,
train and sync), so the server start-up and the first compiles are out of it. Load average is recorded around each
run: on 2 shared cores the trainer and the vLLM engine compete for the same cores, which bounds what overlap can win.

    PYTHONPATH=src python bench/async_rollouts.py                 # ~6 min on 2 CPU cores
    PYTHONPATH=src python bench/async_rollouts.py --steps 30 --ks 0 1 2
    PYTHONPATH=src python bench/async_rollouts.py --analyze /tmp/k0 /tmp/k1   # figures of existing run dirs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "async_rollouts.json"


def figures(run_dir: Path, skip: int = 2) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("step", 0) > 0 and "loss" in r]
    steady = rows[skip:]
    total = sum(r["time/step_seconds"] for r in steady)
    out = {
        "steps": len(rows),
        "steady_steps": len(steady),
        "steady_steps_per_s": len(steady) / total,
        "steady_seconds_per_step": total / len(steady),
        # Robust to other jobs' bursts on a shared machine.
        "median_seconds_per_step": statistics.median(r["time/step_seconds"] for r in steady),
        "min_seconds_per_step": min(r["time/step_seconds"] for r in steady),
        "data_seconds_mean": sum(r["time/data_seconds"] for r in steady) / len(steady),
        "train_seconds_mean": sum(r.get("time/train_seconds", 0.0) for r in steady) / len(steady),
        "sync_seconds_mean": sum(r["sync/seconds"] for r in steady) / len(steady),
        "reward_last5_mean": sum(r["reward/mean"] for r in rows[-5:]) / len(rows[-5:]),
    }
    if "async/staleness_mean" in steady[0]:
        out.update({
            "staleness_mean": sum(r["async/staleness_mean"] for r in steady) / len(steady),
            "dropped_groups": rows[-1]["async/dropped_groups_total"],
            "trainer_wait_seconds_mean": sum(r["async/trainer_wait_seconds"] for r in steady) / len(steady),
            "generator_idle_seconds_mean": sum(r["async/generator_idle_seconds"] for r in steady) / len(steady),
        })
    return out


def run(k: int, steps: int, root: Path) -> dict:
    run_dir = root / f"k{k}_{time.monotonic_ns()}"
    load_before = os.getloadavg()
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "~experiment", f"train.steps={steps}", "eval=off", "logging.plot=false",
         "logging.progress_bar=false", "train.checkpoint_every=1000", f"train.max_staleness={k}",
         f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"k={k} failed:\n{proc.stderr[-3000:]}")
    return {"k": k, "wall_seconds": wall, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            **figures(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--analyze", type=Path, nargs="+", help="run dirs to report instead of running")
    args = ap.parse_args()
    if args.analyze:
        results = [{"run_dir": str(d), **figures(d)} for d in args.analyze]
    else:
        with tempfile.TemporaryDirectory(prefix="grpo_async_bench_") as tmp:
            results = [run(k, args.steps, Path(tmp)) for k in args.ks]
        OUT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "nproc": os.cpu_count(),
                                   "results": results}, indent=2) + "\n")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()

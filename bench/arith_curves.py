"""Held-out accuracy against wall-clock for runs of the skill experiment (experiments/arith_grpo.yaml), in one PNG.

    python bench/arith_curves.py <run dir> [more ...] --out bench/results/arith_grpo_seeds [--label-key train.seed]

Reads each run's metrics.jsonl (rows with `eval/accuracy` from the evaluation component; `time/run_seconds` is the
wall-clock since the training loop began), summary.json (the whole process's wall_seconds, vLLM start-up included)
and .hydra/config.yaml when present. Writes <out>.json (every eval point of every run, and each run's start, best
and last accuracy) and <out>.png (accuracy against seconds, one line per run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import machine  # noqa: E402


def read_run(run_dir: Path) -> dict:
    """The eval points and figures of one run dir."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [{"step": r["step"], "seconds": r.get("time/run_seconds"), "accuracy": r["eval/accuracy"],
               "pass_at_k": r.get("eval/pass@k")} for r in rows if "eval/accuracy" in r]
    if not points:
        raise SystemExit(f"{run_dir}: no eval/accuracy rows in metrics.jsonl (was eval off?)")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    seed = None
    config = run_dir / ".hydra" / "config.yaml"
    if config.exists():
        import yaml

        seed = yaml.safe_load(config.read_text()).get("train", {}).get("seed")
    accuracies = [p["accuracy"] for p in points]
    return {
        "run": str(run_dir), "seed": seed, "points": points, "start_accuracy": accuracies[0],
        "best_accuracy": max(accuracies), "last_accuracy": accuracies[-1],
        "gain_points": round(100 * (accuracies[-1] - accuracies[0]), 1),
        "loop_seconds": points[-1]["seconds"], "wall_seconds": summary.get("wall_seconds"),
    }


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        xs = [p["seconds"] for p in run["points"]]
        ax.plot(xs, [p["accuracy"] for p in run["points"]], marker="o", label=f"seed {run['seed']}")
    ax.set_xlabel("seconds since the training loop began (2-core CPU, vLLM CPU engine)")
    ax.set_ylabel("held-out greedy accuracy (500 items)")
    ax.set_title("GRPO on the arithmetic skill task (experiment=arith_grpo)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True, help="output path without extension (.json and .png are written)")
    args = parser.parse_args()
    runs = [read_run(Path(r)) for r in args.runs]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1) + "\n")
    plot(runs, out.with_suffix(".png"))
    for run in runs:
        print(f"seed {run['seed']}: {run['start_accuracy']:.3f} -> {run['last_accuracy']:.3f} "
              f"(best {run['best_accuracy']:.3f}) in {run['loop_seconds']} s of loop, {run['wall_seconds']} s wall")


if __name__ == "__main__":
    main()

"""Held-out accuracy against wall-clock for runs of the skill experiment (experiments/arith_grpo.yaml), in one PNG.

    python bench/arith_curves.py <run dir> [more ...] --out bench/results/arith_grpo_seeds
    python bench/arith_curves.py <run dir> ... bench/results/trl_arith_s0.json ... --out bench/results/arith_vs_trl

Each argument is one run: a run directory of ours (metrics.jsonl with `eval/accuracy` rows from the evaluation
component, summary.json for the whole process's wall_seconds, .hydra/config.yaml for the seed) or a JSON written by
`bench/trl_arith.py` (TRL's GRPOTrainer on the same task). Writes <out>.json (every eval point of every run, each
run's start, best and last accuracy), <out>.png (accuracy against seconds, one line per run; ours solid, TRL dashed)
and, when TRL runs are given, <out>.md (accuracy at fixed times and the time ours needs to reach TRL's final accuracy).

Time axis (`--x`, default `train`): seconds of training with the held-out evaluation taken out, on both sides. Ours:
`time/run_seconds` (wall-clock since the training loop began; it *includes* every evaluation, which runs inside the
loop) minus the `eval/seconds` of every evaluation up to and including that row. TRL: the callback's
`time/train_seconds` (since on_train_begin, its evaluations excluded). `--x run` plots the raw `time/run_seconds` of
both (evaluations included: ours evaluates greedy + pass@4 samples through vLLM, TRL's side greedy only, so this
axis favours TRL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import machine  # noqa: E402


def _summary(points: list[dict]) -> dict:
    accuracies = [p["accuracy"] for p in points]
    return {"start_accuracy": accuracies[0], "best_accuracy": max(accuracies), "last_accuracy": accuracies[-1],
            "gain_points": round(100 * (accuracies[-1] - accuracies[0]), 1)}


def read_run(run_dir: Path) -> dict:
    """The eval points and figures of one run dir of ours."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points, eval_total = [], 0.0
    for r in rows:
        if "eval/accuracy" not in r:
            continue
        eval_total += r.get("eval/seconds") or 0.0
        run_s = r.get("time/run_seconds")
        points.append({"step": r["step"], "seconds": run_s, "accuracy": r["eval/accuracy"],
                       "train_seconds": None if run_s is None else run_s - eval_total,
                       "eval_seconds": r.get("eval/seconds"), "pass_at_k": r.get("eval/pass@k")})
    if not points:
        raise SystemExit(f"{run_dir}: no eval/accuracy rows in metrics.jsonl (was eval off?)")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    seed, variant = None, ""
    config = run_dir / ".hydra" / "config.yaml"
    if config.exists():
        import yaml

        composed = yaml.safe_load(config.read_text())
        seed = composed.get("train", {}).get("seed")
        overrides = run_dir / ".hydra" / "overrides.yaml"
        # The label names the experiment and the command's other overrides, so variants of ours tell apart.
        given = [o for o in (yaml.safe_load(overrides.read_text()) if overrides.exists() else []) or []
                 if not o.startswith(("train.seed=", "hydra.", "experiment="))]
        variant = " ".join([str(composed.get("name", "")), *given]).strip()
    return {
        "run": str(run_dir), "trainer": "ours", "seed": seed, "variant": variant, "points": points, **_summary(points),
        "loop_seconds": points[-1]["seconds"], "train_seconds": points[-1]["train_seconds"],
        "eval_seconds_total": eval_total, "wall_seconds": summary.get("wall_seconds"),
    }


def read_trl(path: Path) -> dict:
    """The eval points of a `bench/trl_arith.py` JSON."""
    res = json.loads(path.read_text())
    points = [{"step": r["step"], "seconds": r["time/run_seconds"], "train_seconds": r["time/train_seconds"],
               "accuracy": r["eval/accuracy"], "eval_seconds": r["eval/seconds"], "loadavg": r.get("loadavg")}
              for r in res["rows"]]
    return {
        "run": str(path), "trainer": "trl", "seed": res.get("seed"), "points": points, **_summary(points),
        "loop_seconds": points[-1]["seconds"], "train_seconds": points[-1]["train_seconds"],
        "eval_seconds_total": res.get("eval_seconds_total"), "wall_seconds": res.get("wall_seconds_train_call"),
        "generation": res.get("generation"), "loadavg_start": res.get("loadavg_start"),
        "loadavg_end": res.get("loadavg_end"),
    }


def read_any(arg: str) -> dict:
    path = Path(arg)
    return read_trl(path) if path.is_file() and path.suffix == ".json" else read_run(path)


def x_of(point: dict, axis: str) -> float | None:
    return point["train_seconds"] if axis == "train" else point["seconds"]


def accuracy_at(run: dict, t: float, axis: str) -> float | None:
    """The accuracy of the last evaluation at or before `t` seconds (what the run had reached by then); None when
    the run never got there (its last point is earlier than t)."""
    last_x = x_of(run["points"][-1], axis)
    if last_x is None or t > last_x * 1.0001:
        return None
    reached = [p for p in run["points"] if x_of(p, axis) is not None and x_of(p, axis) <= t]
    return reached[-1]["accuracy"] if reached else None


def time_to(run: dict, accuracy: float, axis: str) -> tuple[float | None, int | None]:
    """Seconds and step of the first evaluation at or above `accuracy` (None, None if never)."""
    for p in run["points"]:
        if p["accuracy"] >= accuracy - 1e-9:
            return x_of(p, axis), p["step"]
    return None, None


def label(run: dict) -> str:
    if run["trainer"] == "trl":
        return f"TRL seed {run['seed']}"
    return f"ours {run['variant']} seed {run['seed']}" if run.get("variant") else f"ours seed {run['seed']}"


def comparison(runs: list[dict], axis: str, at: list[float] | None) -> tuple[dict, str]:
    """Accuracy at fixed times for every run, and the time ours needs to reach TRL's final accuracy (markdown)."""
    trl = [r for r in runs if r["trainer"] == "trl"]
    target = statistics.mean(r["last_accuracy"] for r in trl)
    trl_seconds = statistics.mean(x_of(r["points"][-1], axis) for r in trl)
    if not at:
        at = [round(trl_seconds * f, 1) for f in (0.125, 0.25, 0.5, 1.0)]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"Time axis: {'training seconds, evaluation excluded on both sides' if axis == 'train' else 'time/run_seconds, evaluation included'}. "
             f"TRL's final held-out accuracy (mean of {len(trl)} run(s)): **{target:.3f}** after "
             f"**{trl_seconds:.1f} s** (mean). Accuracy at t = the last evaluation at or before t.", "",
             "| run | " + " | ".join(f"acc @ {t:g} s" for t in at) + " | final acc | final step | seconds | s/step "
             "| s to reach TRL final (step) | / TRL s |",
             "|---|" + "---|" * (len(at) + 6)]
    rows = []
    for r in runs:
        last = r["points"][-1]
        secs = x_of(last, axis)
        reach_s, reach_step = time_to(r, target, axis)
        ratio = None if reach_s is None else reach_s / trl_seconds
        rows.append({"run": r["run"], "label": label(r), "at": {str(t): accuracy_at(r, t, axis) for t in at},
                     "final_accuracy": r["last_accuracy"], "final_step": last["step"], "seconds": secs,
                     "seconds_to_trl_final": reach_s, "step_to_trl_final": reach_step, "ratio_to_trl_seconds": ratio})
        lines.append(f"| {label(r)} | " + " | ".join(fmt(accuracy_at(r, t, axis)) for t in at)
                     + f" | {r['last_accuracy']:.3f} | {last['step']} | {secs:.1f} | {secs / max(last['step'], 1):.3f} | "
                     + ("never" if reach_s is None else f"{reach_s:.1f} ({reach_step})")
                     + f" | {'-' if ratio is None else f'{ratio:.2f}'} |")
    verdicts = [row["ratio_to_trl_seconds"] is not None and row["ratio_to_trl_seconds"] <= 0.5
                for row in rows if row["label"].startswith("ours")]
    lines += ["", f"Target (ours reaches TRL's final accuracy in at most half of TRL's seconds): "
              f"{sum(verdicts)} of {len(verdicts)} runs of ours meet it. The time to reach it is only as fine as the "
              "evaluation interval (eval.every / --eval-every)."]
    table = {"axis": axis, "trl_final_accuracy": target, "trl_seconds": trl_seconds, "at": at, "rows": rows,
             "ours_meeting_target": sum(verdicts), "ours_runs": len(verdicts)}
    return table, "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path, axis: str, target: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for run in runs:
        xs = [x_of(p, axis) for p in run["points"]]
        style = "--" if run["trainer"] == "trl" else "-"
        ax.plot(xs, [p["accuracy"] for p in run["points"]], style, marker="o", markersize=3, label=label(run))
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"TRL final {target:.3f}")
    what = "training seconds (held-out eval excluded)" if axis == "train" else "seconds since the loop began (eval included)"
    ax.set_xlabel(f"{what}; 2-core CPU")
    ax.set_ylabel("held-out greedy accuracy (500 items)")
    trainers = {r["trainer"] for r in runs}
    ax.set_title("GRPO on the arithmetic skill task" + (": ours vs TRL GRPOTrainer" if "trl" in trainers else
                                                         " (experiment=arith_grpo)"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="our run dirs and/or bench/trl_arith.py JSONs")
    parser.add_argument("--out", required=True, help="output path without extension (.json, .png, .md are written)")
    parser.add_argument("--x", choices=("train", "run"), default="train",
                        help="time axis: train = evaluation excluded (default), run = time/run_seconds as logged")
    parser.add_argument("--at", type=float, nargs="*", default=None,
                        help="seconds for the table's columns (default: 1/8, 1/4, 1/2 and all of TRL's seconds)")
    args = parser.parse_args()
    runs = [read_any(r) for r in args.runs]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "axis": args.x, "runs": runs}
    target = None
    if any(r["trainer"] == "trl" for r in runs):
        table, markdown = comparison(runs, args.x, args.at)
        result["comparison"] = table
        target = table["trl_final_accuracy"]
        out.with_suffix(".md").write_text(markdown)
        print(markdown)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, out.with_suffix(".png"), args.x, target)
    for run in runs:
        print(f"{label(run)}: {run['start_accuracy']:.3f} -> {run['last_accuracy']:.3f} (best {run['best_accuracy']:.3f}) "
              f"in {run['train_seconds']:.1f} s of training ({run['loop_seconds']:.1f} s with eval), "
              f"{run['wall_seconds'] or float('nan'):.1f} s wall")


if __name__ == "__main__":
    main()

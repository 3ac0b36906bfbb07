"""Asynchronous rollouts on the skill task (issue 18): held-out accuracy against training seconds for
`train.max_staleness` k = 0, 1, 2, several seeds, on this machine's CPU with the vLLM CPU engine.

Each run is `train.py experiment=arith_grpo train.max_staleness=k train.seed=s` with a shorter schedule and a greedy-
only eval (one sample per item, so eval costs little; the greedy accuracy is the figure). Runs are alternated (seed s
starts with a different k) so a drift in the machine's load does not favour one k. The time axis is
`time/run_seconds` minus the eval seconds so far (eval is not training time; both k pay it alike). For each k: the
mean over seeds of the first time its accuracy reaches 90 % of k = 0's mean gain, the speed-up against k = 0, and
the per-step profile (generation, training, waiting, idle seconds).

    PYTHONPATH=src python bench/async_skill.py                       # 3 seeds x k 0,1,2, 200 steps: ~30 min on 2 cores
    PYTHONPATH=src python bench/async_skill.py --analyze DIR...       # figures of existing run dirs (k and seed read back)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arith_curves import read_run, time_to  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def curve(run_dir: Path) -> dict:
    """Eval points (`arith_curves.read_run`: step, training seconds, accuracy), the run's k and seed from its resolved
    config, its staleness and drop counts, and its per-step profile."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "loss" in r and r.get("step", 0) > 0]
    return {"run_dir": str(run_dir), "k": int(cfg.train.max_staleness), "seed": int(cfg.train.seed),
            "points": read_run(run_dir)["points"], "steps": len(steps),
            "staleness_mean": statistics.fmean(r.get("async/staleness_mean", 0.0) or 0.0 for r in steps),
            "dropped_groups": sum(r.get("async/dropped_groups", 0) or 0 for r in steps), "profile": profile(rows)}


PROFILE_KEYS = ("time/step_seconds", "time/data_seconds", "generation/seconds", "time/train_seconds", "sync/seconds",
                "sync/gen_stall_seconds", "async/trainer_wait_seconds", "async/generator_idle_seconds",
                "async/queue_depth")


def profile(rows: list[dict], skip: int = 2) -> dict:
    """Mean per-step seconds (and queue depth) of a run's steady steps (metrics rows): where a step's time goes."""
    rows = [r for r in rows if "loss" in r and r.get("step", 0) > skip]
    out = {}
    for key in PROFILE_KEYS:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = round(statistics.fmean(values), 4)
    return out


def summarise(curves: list[dict], target_share: float = 0.9) -> dict:
    """Per k: final accuracies, seconds per step, and the time to a fixed target: `target_share` of k = 0's mean
    gain (every run reaches it; k = 0's mean final accuracy itself is missed by some k = 0 seeds)."""
    by_k: dict[int, list[dict]] = {}
    for c in curves:
        by_k.setdefault(c["k"], []).append(c)
    start = statistics.fmean(c["points"][0]["accuracy"] for c in by_k[0])
    final0 = statistics.fmean(c["points"][-1]["accuracy"] for c in by_k[0])
    target = start + target_share * (final0 - start)
    out = {"k0_final_accuracy_mean": round(final0, 4), "target_accuracy": round(target, 4), "per_k": {}}
    for k, cs in sorted(by_k.items()):
        times = [time_to(c, target, "train")[0] for c in cs]
        reached = [t for t in times if t is not None]
        out["per_k"][k] = {
            "seeds": [c["seed"] for c in cs],
            "final_accuracy": [c["points"][-1]["accuracy"] for c in cs],
            "train_seconds": [round(c["points"][-1]["train_seconds"], 1) for c in cs],
            "seconds_to_target": [None if t is None else round(t, 1) for t in times],
            "mean_seconds_to_target": round(statistics.fmean(reached), 1) if len(reached) == len(times) else None,
            "staleness_mean": [round(c["staleness_mean"], 3) for c in cs],
            "profile": {key: round(statistics.fmean(c["profile"][key] for c in cs if key in c["profile"]), 4)
                        for key in PROFILE_KEYS if any(key in c["profile"] for c in cs)},
        }
    base = out["per_k"][0]["mean_seconds_to_target"]
    for row in out["per_k"].values():
        t = row["mean_seconds_to_target"]
        row["speedup_vs_k0"] = round(base / t, 3) if base and t else None
    return out


def plot(curves: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {0: "tab:blue", 1: "tab:orange", 2: "tab:green"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        ax.plot([p["train_seconds"] for p in c["points"]], [p["accuracy"] for p in c["points"]],
                color=colours.get(c["k"], "grey"), alpha=0.8, marker="o", ms=3,
                label=f"k={c['k']}" if c["seed"] == min(x["seed"] for x in curves if x["k"] == c["k"]) else None)
    ax.set_xlabel("training seconds (eval excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("arith_grpo, train.max_staleness = k (each line one seed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(k: int, seed: int, steps: int, every: int, root: Path) -> Path:
    run_dir = root / f"k{k}_s{seed}"
    # A rerun of the bench replaces its own earlier run (train.py refuses a fresh run into a dir that holds one).
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "train.py"), "experiment=arith_grpo", f"train.max_staleness={k}",
           f"train.seed={seed}", f"train.steps={steps}", f"eval.every={every}", "eval.samples_per_prompt=1",
           "eval.k=1", "train.checkpoint_every=1000", "logging.progress_bar=false", f"hydra.run.dir={run_dir}"]
    print(" ".join(cmd[1:]), f"(load {os.getloadavg()[0]:.2f})", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return run_dir


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--root", type=Path, default=Path("/tmp/async_skill"))
    ap.add_argument("--analyze", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=RESULTS / "async_skill")
    a = ap.parse_args(argv)
    if a.analyze:
        dirs = a.analyze
    else:
        dirs, loads = [], []
        for i, seed in enumerate(a.seeds):
            for k in a.ks[i % len(a.ks):] + a.ks[: i % len(a.ks)]:  # alternate which k goes first
                loads.append(os.getloadavg()[0])
                dirs.append(run(k, seed, a.steps, a.every, a.root))
    curves = [curve(d) for d in dirs]
    result = {"bench": "async_skill", "command": " ".join(["python bench/async_skill.py", *(argv or sys.argv[1:])]),
              "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
              "summary": summarise(curves), "curves": curves}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(curves, a.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    main()

"""Issue 40's sanity table: held-out accuracy of each algorithm on the CPU skill task, one seed each, same steps.

    python bench/algorithms_table.py                       # every variant, one after another
    python bench/algorithms_table.py --only gspo cispo     # some of them (results merged into the JSON)
    python bench/algorithms_table.py --table               # print the markdown table from the JSON

Each variant is one `train.py` run of `experiment=arith_grpo` (the warm-started tiny model on the arithmetic task)
with the loss table's settings (bench/README.md, "Loss sanity table"): 200 optimizer steps = 50 rollout batches of
4 updates (2 epochs x 2 mini-batches), so the ratio leaves 1 and the clips act; held-out greedy accuracy from the
in-run evaluation every 50 steps. Runs go one after another (never in parallel: the machine is shared). Per run:
accuracy by step, the mean clipped fraction, the mean `mismatch/kl` and masked fraction, the mean refill rounds and
groups generated per group kept (dynamic sampling), and the run's wall seconds. `results/algorithms_table.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, machine

BASE = ("experiment=arith_grpo train.steps=200 train.ppo_epochs=2 train.mini_batches=2 eval.every=50 "
        "train.checkpoint_every=1000 logging.progress_bar=false logging.plot=false")
VARIANTS = {
    "grpo": "loss=grpo",
    "dapo": "loss=dapo",
    "dr_grpo": "loss=dr_grpo train.advantage_norm=dr_grpo",
    "gspo": "loss=gspo",
    "cispo": "loss=cispo",
    "rloo": "loss=grpo train.advantage_norm=rloo",
    "grpo_masks": "loss=grpo loss.old_logprobs=recompute loss.token_mask=[0.5,2.0] loss.sequence_mask=[0.9,1.1]",
    "dapo_dynamic": "loss=dapo data.dynamic_sampling=true",
}
OUT = RESULTS / "algorithms_table.json"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(sum(values) / len(values), 4) if values else None


def run(name: str, runs_dir: Path) -> dict:
    """One variant's run and its figures from metrics.jsonl."""
    run_dir = runs_dir / name
    command = f"python train.py {BASE} {VARIANTS[name]} hydra.run.dir={run_dir}"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "train.py", *shlex.split(BASE), *shlex.split(VARIANTS[name]),
                    f"hydra.run.dir={run_dir}"], cwd=ROOT, check=True, env={**os.environ})
    wall = time.monotonic() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {}
    for r in rows:
        if r.get("eval/accuracy") is not None:
            evals[str(r["step"])] = r["eval/accuracy"]
    return {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_end": list(os.getloadavg()),
        "acc": evals, "clipped_fraction_mean": _mean(rows, "grpo/clipped_fraction"),
        "mismatch_kl_mean": _mean(rows, "mismatch/kl"), "masked_fraction_mean": _mean(rows, "mismatch/masked_fraction"),
        "refill_rounds_mean": _mean(rows, "data/refill_rounds"),
        "generated_per_kept_mean": _mean(rows, "data/groups_generated_per_kept"), "wall_seconds": round(wall),
    }


def table(results: dict) -> str:
    """The markdown table of the runs in ``results``."""
    lines = ["| variant | overrides | acc step 0 | 100 | 200 | gain | clipped fraction | mismatch/kl | masked | "
             "refill rounds | generated/kept | wall s | date |", "|" + "---|" * 13]
    for name, r in results["runs"].items():
        acc = r["acc"]
        first, mid, last = acc.get("0"), acc.get("100"), acc.get("200")
        gain = f"{100 * (last - first):+.1f}" if first is not None and last is not None else ""
        cells = [name, f"`{VARIANTS.get(name, '')}`", first, mid, last, gain, r["clipped_fraction_mean"],
                 r["mismatch_kl_mean"], r["masked_fraction_mean"], r["refill_rounds_mean"],
                 r["generated_per_kept_mean"], r["wall_seconds"], r["date"]]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), help="variants to run (default: all)")
    parser.add_argument("--runs-dir", default="/tmp/grpo_algorithms_table", help="where the run dirs go")
    parser.add_argument("--table", action="store_true", help="print the table from the JSON and run nothing")
    args = parser.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {"bench": "algorithms_table", "base": BASE, "runs": {}}
    if not args.table:
        for name in args.only or list(VARIANTS):
            results["runs"][name] = run(name, Path(args.runs_dir))
            results["machine"] = machine()
            OUT.write_text(json.dumps(results, indent=1) + "\n")  # after each run: a stop keeps the ones done
    print(table(results))


if __name__ == "__main__":
    main()

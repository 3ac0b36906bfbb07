"""The long-completion table from a plan's results (bench/gpu/plans/long_completions_*_2gpu.txt, run by run_plan.py):
per job, the median of its steps after the first (vLLM's and the kernels' warm-up) of the step's seconds and parts,
trainer MFU, device memory peak and generation's share; TRL's step beside them. Only what the files hold: a figure a
job did not log stays empty.

    python bench/gpu/long_completions.py /tmp/plan_out --out bench/results/gpu/long_completions

Writes `<out>/long_completions.json` (one row per job) and `<out>/long_completions.md` (the table).

Columns: `step s` (time/step_seconds), `wait s` (time/data_seconds: the trainer waiting for the rollout batch;
asynchronous rollouts hide generation behind training, so this, not `gen s`, is what generation costs the step),
`gen s` (generation/seconds: the batch's generation however it overlapped), `train s` (time/train_seconds), `sync s`
(sync/seconds), `gen share` (gen s / step s), `wait share` (wait s / step s), `MFU` (perf/mfu), `peak GiB`
(memory/peak_gb, the trainer's allocator peak, the largest of the job) and `tokens/s` (tokens/trained / step s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_files import find, read_rows  # noqa: E402

PARTS = {"step_s": "time/step_seconds", "wait_s": "time/data_seconds", "gen_s": "generation/seconds",
         "train_s": "time/train_seconds", "sync_s": "sync/seconds", "mfu": "perf/mfu", "tokens": "tokens/trained"}
COLUMNS = [("job", "job"), ("steps", "steps"), ("step s", "step_s"), ("wait s", "wait_s"), ("gen s", "gen_s"),
           ("train s", "train_s"), ("sync s", "sync_s"), ("gen share", "gen_share"), ("wait share", "wait_share"),
           ("MFU", "mfu"), ("peak GiB", "peak_gb"), ("tokens/s", "tokens_per_s")]


def _median(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def ours(name: str, rows: list[dict]) -> dict:
    """One train.py job's row: medians over its steps after the first."""
    steps = [r for r in rows if "time/step_seconds" in r]
    steady = steps[1:] or steps
    out: dict = {"job": name, "impl": "ours", "steps": len(steps)}
    out |= {k: _median(steady, key) for k, key in PARTS.items()}
    peaks = [float(r["memory/peak_gb"]) for r in steps if isinstance(r.get("memory/peak_gb"), (int, float))]
    out["peak_gb"] = max(peaks) if peaks else None
    step = out["step_s"]
    for share, part in (("gen_share", "gen_s"), ("wait_share", "wait_s")):
        out[share] = out[part] / step if step and out[part] is not None else None
    out["tokens_per_s"] = out.pop("tokens") / step if step and out.get("tokens") is not None else None
    return out


def trl(name: str, result: dict) -> dict:
    """A bench/gpu/trl_step.py job's row: its steady median step (the first step reported apart)."""
    return {"job": name, "impl": "trl", "steps": len(result.get("step_s") or []),
            "step_s": result.get("steady_step_s_median")}


def collect(folder: Path) -> list[dict]:
    """Every job of the plan's output folder: train.py jobs by their metrics, TRL jobs by their result file."""
    rows = [ours(p.name.removesuffix(".metrics.jsonl"), read_rows(p)) for p in find(folder, "*.metrics.jsonl")]
    for p in sorted(folder.glob("*.json")):
        result = json.loads(p.read_text())
        if isinstance(result, dict) and result.get("impl") == "trl":
            rows.append(trl(p.stem, result))
    return sorted(rows, key=lambda r: r["job"])


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.1f}"
    return str(value)


def markdown(rows: list[dict]) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for _, k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, help="the plan's --out folder (or a copy of it)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = collect(args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_completions.json").write_text(json.dumps(rows, indent=1))
    (args.out / "long_completions.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()

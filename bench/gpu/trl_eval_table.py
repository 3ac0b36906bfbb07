"""One seed of the TRL comparison scored by one evaluator: our run's own evaluations (metrics.jsonl) beside TRL's
checkpoints evaluated by grpo-eval (the same vLLM greedy accuracy and pass@k, grading, items and seeds), step by
step, with each side's clock and TRL's own in-run figure (transformers generate()) for reference.

    python bench/gpu/trl_eval_table.py OURS_METRICS.jsonl TRL.json TRL_EVAL.json [--out table.md]

OURS_METRICS: `bash bench/gpu/real_model.sh train S` (metrics_shared_sS.jsonl); TRL.json: `... trl S`
(trl_sS.json, its rows' clocks); TRL_EVAL.json: `... trl_eval S` (grpo-eval of TRL's checkpoints, trl_eval_sS.json).
Clocks: ours `time/run_seconds` (since the training loop started; evaluations included); TRL `time/run_seconds`
(since on_train_begin; its own evaluations and saves included) and `time/process_seconds` (since the script started).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_by_step(rows: list[dict], key: str = "eval/accuracy") -> dict[int, dict]:
    return {int(r["step"]): r for r in rows if key in r}


def table(ours: dict[int, dict], trl_run: dict[int, dict], trl_eval: dict[int, dict]) -> str:
    """A Markdown table over every step that either side evaluated."""
    def num(row: dict | None, key: str, fmt: str) -> str:
        return format(row[key], fmt) if row is not None and row.get(key) is not None else ""

    lines = ["| step | ours accuracy | ours pass@k | ours run s | TRL accuracy (grpo-eval) | TRL pass@k (grpo-eval) "
             "| TRL run s | TRL process s | TRL accuracy (its own eval) |", "|" + " --- |" * 9]
    for step in sorted(set(ours) | set(trl_eval) | set(trl_run)):
        o, t, e = ours.get(step), trl_run.get(step), trl_eval.get(step)
        lines.append(f"| {step} | {num(o, 'eval/accuracy', '.3f')} | {num(o, 'eval/pass@k', '.3f')} | "
                     f"{num(o, 'time/run_seconds', '.0f')} | {num(e, 'eval/accuracy', '.3f')} | "
                     f"{num(e, 'eval/pass@k', '.3f')} | {num(t, 'time/run_seconds', '.0f')} | "
                     f"{num(t, 'time/process_seconds', '.0f')} | {num(t, 'eval/accuracy', '.3f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours", type=Path, help="our run's metrics.jsonl")
    ap.add_argument("trl", type=Path, help="bench/trl_arith.py's JSON")
    ap.add_argument("trl_eval", type=Path, help="grpo-eval's JSON of TRL's checkpoints")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    ours = rows_by_step([json.loads(x) for x in args.ours.read_text().splitlines() if x.strip()])
    trl_run = rows_by_step(json.loads(args.trl.read_text())["rows"])
    trl_eval = rows_by_step(json.loads(args.trl_eval.read_text())["rows"])
    out = table(ours, trl_run, trl_eval)
    print(out)
    if args.out:
        args.out.write_text(out + "\n")
    return out


if __name__ == "__main__":
    main()

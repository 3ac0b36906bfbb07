"""The policy's entropy (`grpo/entropy`) and held-out accuracy against the step, from runs' metrics (plain or .gz).

    python bench/gpu/entropy_curve.py bench/results/gpu/real_model/lease13/ent_on_s3.metrics.jsonl --out entropy.png

Prints the entropy at a few steps (and each evaluation's accuracy), and writes one PNG: entropy on the left axis,
accuracy on the right, one line pair per metrics file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from result_files import read_rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` where a row has it."""
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files (a .gz copy is read when only it is there)")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    acc_ax = ax.twinx()
    for i, path in enumerate(args.metrics):
        rows = read_rows(path)
        name = path.name.split(".")[0]
        steps, entropy = series(rows, "grpo/entropy")
        at = {s: round(e, 3) for s, e in zip(steps, entropy) if s in (1, 5, 10, 25, 50, 100, 150, 200, 300, 400, 500)}
        evals = dict(zip(*series(rows, "eval/accuracy")))
        print(f"{name}: entropy at steps {at}; held-out accuracy {evals}")
        ax.plot(steps, entropy, lw=1.2, color=f"C{2 * i}", label=f"{name} entropy")
        acc_ax.plot(list(evals), list(evals.values()), marker="o", ls="--", color=f"C{2 * i + 1}",
                    label=f"{name} accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("grpo/entropy (nats per token)")
    acc_ax.set_ylabel("held-out greedy accuracy")
    ax.legend(loc="center right", fontsize=8)
    acc_ax.legend(loc="right", bbox_to_anchor=(1.0, 0.3), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

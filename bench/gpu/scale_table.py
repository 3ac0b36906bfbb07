"""The scaling table of bench/gpu/README.md from a plan's results: one row per run (a `<name>.metrics.jsonl` that
bench/gpu/run_plan.py collected, or the `<name>.metrics.partial.jsonl` a `collect` copied while the run was still
going), medians over the steps after the first `--skip` (start-up, compilation).

    python bench/gpu/scale_table.py bench/results/gpu/scale_out_4gpu [--skip 3] [--until 60] [--sync | --pipeline]

`--sync` gives the weight sync's columns instead: its seconds, the server's part phase by phase, bytes, and whether the
served weights matched the trainer's (mode=broadcast's `sync/server_*_seconds`; "-" where a mode has none).
`--pipeline` gives asynchronous rollouts' columns: the step's mean beside its median (two batches in flight make step
times alternate, and the mean is what a run's length is made of), the trainer's wait for its batch and the
generator's idle time (means), a batch's generation, training and the arrival check (medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_files import find, read_rows  # noqa: E402

# A column is a metrics.jsonl key (its median over the steady steps) or "mean:key" / "min:key" -> its heading.
SUMMARIES = {"mean": statistics.mean, "min": min}
COLUMNS = {  # metrics.jsonl key -> column heading
    "time/step_seconds": "step s",
    "generation/seconds": "generation s",
    "generation/tokens_per_s": "generation tokens/s",
    "time/train_seconds": "train s",
    "sync/seconds": "sync s",
    "perf/mfu": "MFU",
}


SYNC_COLUMNS = {  # the same for the weight sync (--sync)
    "sync/seconds": "sync s",
    "sync/server_seconds": "server s",
    "sync/server_start_seconds": "start s",
    "sync/server_receive_seconds": "receive s",
    "sync/server_finish_seconds": "finish s",
    "sync/server_empty_cache_seconds": "cache emptying s",
    "sync/server_reset_prefix_cache_seconds": "prefix-cache reset s",
    "sync/bytes": "bytes",
    "min:sync/weights_match": "weights match (worst)",  # any mismatch shows: the worst step
}


PIPELINE_COLUMNS = {  # the same for asynchronous rollouts (--pipeline)
    "mean:time/step_seconds": "step s (mean)",
    "time/step_seconds": "step s (median)",
    "mean:async/trainer_wait_seconds": "trainer wait s (mean)",
    "mean:async/generator_idle_seconds": "generator idle s (mean)",
    "generation/seconds": "generation s",
    "time/train_seconds": "train s",
    "sync/arrival_check_seconds": "arrival check s",
}


def row(path: Path, skip: int, until: int | None = None, columns: dict[str, str] = COLUMNS) -> list[str]:
    rows = read_rows(path)
    steady = [r for r in rows if r.get("step", 0) > skip and (until is None or r.get("step", 0) <= until)] or rows
    cells = []
    for column in columns:
        stat, _, key = column.rpartition(":")
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        summary = SUMMARIES.get(stat, statistics.median)
        cells.append(f"{summary(values):.3g}" if values else "-")
    replicas = sum(1 for k in rows[-1] if k.startswith("server/replica") and k.endswith("/requests")) or 1
    return [path.name.split(".")[0], str(replicas), str(len(rows)), *cells]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--skip", type=int, default=3, help="steps left out at the start")
    ap.add_argument("--until", type=int, default=None,
                    help="last step counted (runs of different lengths compared over the same steps)")
    view = ap.add_mutually_exclusive_group()
    view.add_argument("--sync", action="store_true", help="the weight sync's columns (phases, bytes, match)")
    view.add_argument("--pipeline", action="store_true", help="asynchronous rollouts' columns (means, waits)")
    args = ap.parse_args()
    columns = SYNC_COLUMNS if args.sync else PIPELINE_COLUMNS if args.pipeline else COLUMNS
    head = ["run", "replicas", "rows", *columns.values()]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    finished = find(args.folder, "*.metrics.jsonl")
    names = {p.name.split(".")[0] for p in finished}
    partial = [p for p in find(args.folder, "*.metrics.partial.jsonl") if p.name.split(".")[0] not in names]
    for path in sorted(finished + partial):
        print("| " + " | ".join(row(path, args.skip, args.until, columns)) + " |")


if __name__ == "__main__":
    main()

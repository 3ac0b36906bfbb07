"""Run a command (a training run) and profile it in its steady state: once its metrics.jsonl has ``--after-rows``
rows, py-spy samples the command's whole process tree (trainer, vLLM's API server, engine core, worker) for
``--seconds`` without pausing it, and the stacks are summed per process (bench/gpu/pyspy_stacks.py).

    python bench/gpu/pyspy_run.py --metrics RUN/metrics.jsonl --after-rows 60 --seconds 30 --out OUT/name -- \\
        python train.py experiment=smollm2_chat_arith_shared ...

Writes OUT/name.pyspy.txt (py-spy's raw collapsed stacks) and OUT/name.pyspy.json (the summary). The command runs
to its end whatever py-spy does (a profiler that cannot attach, as where ptrace is not allowed, costs the run
nothing: the reason goes into the JSON), and this script exits with the command's return code. bench/gpu/run_plan.py
starts it for a plan job whose first override (after ``gpus=``) is ``pyspy=ROWS:SECONDS``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pyspy_stacks import finish_recording, start_recording  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", required=True, type=Path, help="the run's metrics.jsonl")
    ap.add_argument("--after-rows", type=int, default=60, help="start sampling once the metrics have this many rows")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long py-spy samples")
    ap.add_argument("--rate", type=int, default=200, help="samples per second")
    ap.add_argument("--out", required=True, type=Path, help="OUT/name: writes OUT/name.pyspy.txt and .pyspy.json")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    return ap


def rows(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def profile(pid: int, args: argparse.Namespace, raw: Path) -> dict:
    """py-spy on `pid` and its children for `args.seconds`; the summary, or why there is none."""
    rec = start_recording(pid, raw, rate=args.rate)
    return {"seconds": args.seconds, "rate": args.rate, **finish_recording(rec, raw, args.seconds)}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("pyspy_run.py: give the command after --")
    raw, summary = args.out.with_name(args.out.name + ".pyspy.txt"), args.out.with_name(args.out.name + ".pyspy.json")
    proc = subprocess.Popen(command)
    result: dict = {"error": f"the command ended before its metrics had {args.after_rows} rows"}
    while proc.poll() is None:
        written = rows(args.metrics)
        if written >= args.after_rows:
            try:
                result = {"after_rows": written, **profile(proc.pid, args, raw)}
            except Exception as error:  # the run goes on whatever the profiler does
                result = {"error": f"{type(error).__name__}: {error}"}
            break
        time.sleep(1.0)
    summary.write_text(json.dumps(result, indent=1))
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())

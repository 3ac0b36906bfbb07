"""End-to-end step time per sync mode, split into generate / score / train / sync, from real ``train.py`` runs.

    python bench/e2e_modes.py [--modes none lora_only lora_restart] [--steps 4] [--overrides key=value ...]

Runs ``python train.py mode=<mode> train.steps=<steps>`` (the default job otherwise: tiny Qwen2, digits task,
8 prompts x 8 completions of <= 16 tokens, micro-batch 32 x 2, vLLM CPU engine) on a free port, then reads its
``metrics.jsonl``: generate = ``generation/seconds``, score = ``time/data_seconds`` - generate (decode + rewards +
grouping), train = ``time/train_seconds`` (batching + forward/backward + optimizer), of which forward/backward =
``time/forward_backward_seconds``, sync = ``sync/seconds``, step = ``time/step_seconds``. Step 1 is reported but
left out of the medians (first-call warm-up). Server launch time is the run's wall time minus the steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, free_port, loadavg, machine  # noqa: E402

KEYS = {"generate": "generation/seconds", "train": "time/train_seconds", "fwd_bwd": "time/forward_backward_seconds",
        "sync": "sync/seconds", "step": "time/step_seconds"}  # fmt: skip


def run_mode(mode: str, steps: int, base: Path, extra: list[str], reuse: bool = False) -> dict:
    run_dir = base / mode
    cmd = [sys.executable, "train.py", "~experiment", f"mode={mode}", f"train.steps={steps}", f"server.port={free_port()}",
           "logging.progress_bar=false", "logging.plot=false", f"train.checkpoint_every={steps}",
           f"hydra.run.dir={run_dir}", *extra]  # fmt: skip
    wall = float("nan")
    if not reuse:
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    per_step = []
    for r in rows:
        d = {k: float(r.get(v, 0.0)) for k, v in KEYS.items()}
        d["score"] = float(r["time/data_seconds"]) - d["generate"]
        d["reward"] = float(r.get("reward/mean", float("nan")))
        d["trained_tokens_per_s"] = float(r.get("throughput/trained_tokens_per_s", 0.0))
        d["peak_gb"] = float(r.get("memory/peak_gb", 0.0))
        per_step.append(d)
    body = per_step[1:] or per_step
    med = {k: statistics.median(s[k] for s in body) for k in per_step[0]}
    return {"mode": mode, "command": " ".join(cmd[1:]), "wall_seconds": wall,
            "launch_and_teardown_seconds": wall - sum(s["step"] for s in per_step), "median": med,
            "steps": per_step, "loadavg_end": loadavg()}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["none", "lora_only", "lora_restart"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--overrides", nargs="*", default=[], help="extra train.py overrides for every mode")
    ap.add_argument("--reuse", help="read the run dirs <REUSE>/<mode> of an earlier invocation instead of running")
    ap.add_argument("--out", default=str(RESULTS / "e2e_modes.json"))
    args = ap.parse_args(argv)
    extra = args.overrides
    base = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    results = []
    for mode in args.modes:
        res = run_mode(mode, args.steps, base, extra, reuse=bool(args.reuse))
        m = res["median"]
        print(f"  {mode:12} step {m['step']:.2f}s = generate {m['generate']:.2f} + score {m['score']:.3f} + train "
              f"{m['train']:.2f} + sync {m['sync']:.2f}  (load {res['loadavg_end']:.1f})", flush=True)  # fmt: skip
        results.append(res)
    out = {"bench": "e2e_modes", "machine": machine(),
           "command": "python bench/e2e_modes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "results": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(out))
    return out


def table(out: dict) -> str:
    lines = ["| mode | step s | generate s | score s | train s (fwd+bwd) | sync s | trained tok/s | peak GB | launch+teardown s |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in out["results"]:
        m = r["median"]
        lines.append(f"| {r['mode']} | {m['step']:.2f} | {m['generate']:.2f} | {m['score']:.3f} | {m['train']:.2f} "
                     f"({m['fwd_bwd']:.2f}) | {m['sync']:.3f} | {m['trained_tokens_per_s']:.0f} | {m['peak_gb']:.2f} "
                     f"| {r['launch_and_teardown_seconds']:.0f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()

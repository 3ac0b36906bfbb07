"""Where a run's start-up goes: `train.py` launched as a user launches it, each line of its output stamped on arrival.

    python bench/gpu/startup_probe.py --tag default -- experiment=smollm2_chat_arith_shared train.steps=20 ...

Reports, in seconds from the process's start: vLLM launched, vLLM ready, the first optimizer step done (the progress
bar's `1/N`), the last step, the exit; and the phases vLLM logs itself (weights, torch.compile, CUDA-graph capture,
engine init) from the run's `logs/vllm.log`. Writes one JSON object to --out (appended as a line).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# vLLM's own start-up messages and the number each carries (seconds).
VLLM_PHASES = {
    "weights_load_s": r"Loading weights took ([\d.]+) seconds",
    "model_load_s": r"Model loading took [\d.]+ Gi?B and ([\d.]+) seconds",
    "dynamo_bytecode_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "compile_s": r"torch\.compile takes ([\d.]+) s in total",
    "compile_range_s": r"Compiling a graph for [^\n]* takes ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) seconds",
    # The command's preloaded process (grpo.inference.preload): its imports, and how long the launch waited for them.
    "preload_import_s": r"the imports took ([\d.]+) s and ended",
    "preload_import_after_launch_s": r"ended ([\d.]+) s after the launch",
}


def stamp_stream(stream, start: float, events: list[tuple[float, str]]) -> None:
    """Append (seconds since start, text) for each chunk of the stream (tqdm writes \\r-separated updates)."""
    buf = b""
    while True:
        chunk = stream.read1(4096) if hasattr(stream, "read1") else stream.read(4096)
        if not chunk:
            break
        now = time.monotonic() - start
        buf += chunk
        parts = re.split(rb"[\r\n]", buf)
        buf = parts.pop()
        events.extend((now, p.decode(errors="replace")) for p in parts if p.strip())
    if buf.strip():
        events.append((time.monotonic() - start, buf.decode(errors="replace")))


def first(events: list[tuple[float, str]], pattern: str) -> float | None:
    rx = re.compile(pattern)
    return next((t for t, text in events if rx.search(text)), None)


def vllm_phases(log: Path) -> dict[str, float]:
    text = log.read_text(errors="replace") if log.exists() else ""
    out: dict[str, float] = {}
    for key, pattern in VLLM_PHASES.items():
        found = [float(x) for x in re.findall(pattern, text)]
        if found:
            out[key] = round(sum(found), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    run_dir = Path(args.run_dir or f"/tmp/runs/startup_{args.tag}")
    steps = next((int(o.split("=", 1)[1]) for o in args.overrides if o.startswith("train.steps=")), None)
    cmd = [sys.executable, "train.py", *args.overrides, f"hydra.run.dir={run_dir}", "logging.progress_bar=true"]
    events: list[tuple[float, str]] = []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    reader = threading.Thread(target=stamp_stream, args=(proc.stdout, start, events), daemon=True)
    reader.start()
    rc = proc.wait()
    reader.join(timeout=10)
    result = {
        "tag": args.tag, "rc": rc, "overrides": args.overrides,
        "exit_s": round(time.monotonic() - start, 2),
        "vllm_launch_s": first(events, r"starting vLLM|grpo: starting"),
        "vllm_ready_s": first(events, r"vLLM ready"),
        "first_step_s": first(events, r"\b1/\d+ \["),
        "last_step_s": first(events, rf"\b{steps}/{steps} \[") if steps else None,
        "vllm": vllm_phases(run_dir / "logs" / "vllm.log"),
    }
    summary = run_dir / "summary.json"
    if summary.exists():
        result["summary"] = json.loads(summary.read_text())
    print(json.dumps(result))
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    Path(args.out).with_suffix(f".{args.tag}.log").write_text("\n".join(f"{t:8.2f} {x}" for t, x in events))


if __name__ == "__main__":
    main()

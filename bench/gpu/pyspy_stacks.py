"""py-spy recordings of a process tree, summed per process, for the profiles the GPU benchmarks take
(bench/gpu/gen_probe.py --py-spy, bench/gpu/pyspy_run.py): where each process of a run (trainer, vLLM's API server,
engine core, worker) spends its samples."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

MISSING = "py-spy is not installed (scripts/device/make-project-wheels puts its wheel in the kit)"


@dataclass
class Recording:
    """A py-spy recording under way: its process and when it started (`time.monotonic()`)."""

    proc: subprocess.Popen
    started: float


def start_recording(pid: int, raw: Path, rate: int = 200) -> Recording | None:
    """py-spy recording `pid` and its children into `raw` (collapsed stacks; on-CPU samples only, the processes not
    paused) until `finish_recording` stops it; None when py-spy is not installed. No `--duration`: py-spy counts it in
    samples, and walking a dozen processes it falls behind its rate, so its window would outlast the one asked for."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", str(rate),
           "--format", "raw", "--output", str(raw)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Recording(proc, time.monotonic())


def finish_recording(rec: Recording | None, raw: Path, seconds: float) -> dict:
    """Stop the recording `seconds` of wall-clock after it started (SIGINT: py-spy writes what it has; it ends by
    itself if the sampled process does first) and summarize it (`summarize_stacks`), or say why there is none."""
    if rec is None:
        return {"error": MISSING}
    try:
        rec.proc.wait(timeout=max(0.0, rec.started + seconds - time.monotonic()))
    except subprocess.TimeoutExpired:
        rec.proc.send_signal(signal.SIGINT)
    out, _ = rec.proc.communicate(timeout=120)
    window_s = round(time.monotonic() - rec.started, 2)
    if rec.proc.returncode != 0 or not raw.exists():
        return {"error": f"py-spy exited {rec.proc.returncode}: {out[-800:]}"}
    return {"window_s": window_s, **summarize_stacks(raw.read_text(errors="replace"))}


def summarize_stacks(collapsed: str, top: int = 25) -> dict:
    """py-spy's collapsed stacks ("process 12:cmd;frame (file:line);... COUNT" per line) summed per process: its
    samples, the frames where they were taken (self) and the frames anywhere on their stacks (inclusive, once per
    stack), line numbers dropped so a function counts as one."""
    per: dict[str, dict[str, Counter]] = defaultdict(lambda: {"self": Counter(), "inclusive": Counter()})
    totals: Counter = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # With --subprocesses a child's stack starts with its ancestors' "process PID:cmd" frames: the last is its own.
        marks = [i for i, f in enumerate(frames) if f.startswith("process ")]
        process = frames[marks[-1]][:80] if marks else "?"
        names = [re.sub(r":\d+\)$", ")", f) for f in frames[(marks[-1] + 1 if marks else 0):]]
        n = int(count)
        totals[process] += n
        if names:
            per[process]["self"][names[-1]] += n
        for name in set(names):
            per[process]["inclusive"][name] += n
    return {"processes": {
        proc: {"samples": totals[proc],
               "self": [(k, v) for k, v in per[proc]["self"].most_common(top)],
               "inclusive": [(k, v) for k, v in per[proc]["inclusive"].most_common(top)]}
        for proc, _ in totals.most_common()
    }}  # fmt: skip

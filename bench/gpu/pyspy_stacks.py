"""py-spy recordings of a process tree, summed per process, for the profiles the GPU benchmarks take
(bench/gpu/gen_probe.py --py-spy, bench/gpu/pyspy_run.py): where each process of a run (trainer, vLLM's API server,
engine core, worker) spends its samples."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

MISSING = "py-spy is not installed (scripts/device/make-project-wheels puts its wheel in the kit)"


def start_recording(pid: int, seconds: float, raw: Path, rate: int = 200) -> subprocess.Popen | None:
    """py-spy recording `pid` and its children for `seconds` into `raw` (collapsed stacks; on-CPU samples only, the
    processes not paused); None when py-spy is not installed."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", str(rate),
           "--duration", str(max(1, int(seconds))), "--format", "raw", "--output", str(raw)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_recording(spy: subprocess.Popen | None, raw: Path, seconds: float) -> dict:
    """The summary of a recording once py-spy has ended (`summarize_stacks`), or why there is none."""
    if spy is None:
        return {"error": MISSING}
    out, _ = spy.communicate(timeout=seconds + 120)
    if spy.returncode != 0 or not raw.exists():
        return {"error": f"py-spy exited {spy.returncode}: {out[-800:]}"}
    return summarize_stacks(raw.read_text(errors="replace"))


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

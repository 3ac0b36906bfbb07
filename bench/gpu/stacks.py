"""py-spy's collapsed stacks summed per process, for the profiles the GPU benchmarks take (bench/gpu/gen_probe.py
--py-spy, bench/gpu/pyspy_run.py): where each process of a run (trainer, vLLM's API server, engine core, worker)
spends its samples."""

from __future__ import annotations

import re
from collections import Counter, defaultdict


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

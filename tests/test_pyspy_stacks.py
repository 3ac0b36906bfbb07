"""bench/gpu/pyspy_stacks.py (gen_probe.py --py-spy, pyspy_run.py) reads py-spy's collapsed stacks of the whole server tree: each stack must count for
the process that was sampled (the last "process" frame: a child's stack begins with its ancestors'), its own frames
only, a function once per stack however many of its lines appear, and the frame on top as "self"."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import pyspy_stacks  # noqa: E402

API = 'process 10:"python -m grpo.inference.server"'
CORE = 'process 11:"VLLM::EngineCore"'
STACKS = "\n".join([
    f"{API};main (server.py:5);handle (server.py:40) 7",
    f"{API};main (server.py:5);handle (server.py:41);handle (server.py:42) 3",
    f"{API};{CORE};busy_loop (core.py:100);step (core.py:200);encode (serial_utils.py:3) 5",
    f"{API};{CORE};busy_loop (core.py:100);step (core.py:201) 2",
    "a line without a count",
])


def test_stacks_are_summed_per_sampled_process_with_self_and_inclusive_frames():
    procs = pyspy_stacks.summarize_stacks(STACKS)["processes"]
    assert list(procs) == [API, CORE]  # most samples first
    api, core = procs[API], procs[CORE]
    assert (api["samples"], core["samples"]) == (10, 7)
    assert dict(api["self"]) == {"handle (server.py)": 10}
    assert dict(api["inclusive"]) == {"main (server.py)": 10, "handle (server.py)": 10}  # once per stack
    assert dict(core["self"]) == {"encode (serial_utils.py)": 5, "step (core.py)": 2}
    assert dict(core["inclusive"])["step (core.py)"] == 7
    assert not any("server.py" in name for name, _ in core["inclusive"])  # the parent's frames are not the child's

"""Soak: 200 local steps of `train.py` (tiny model, digits task, its own vLLM CPU server) with the server SIGKILLed at
steps 50, 100 and 150 and a SIGTERM inside step 120's checkpoint write, then `train.resume=<run dir>` to the end.

Checked and recorded in bench/results/soak.json:
- every step 1..200 in metrics.jsonl exactly once (the resumed run trims the rows past its checkpoint);
- the trainer's RSS and open file descriptors flat within each session (read from /proc/self every step:
  `memory/rss_gb`, `proc/open_fds`): median RSS and max fds of a window after warm-up vs the session's last window;
- the server restarts (3, one per kill) and every checkpoint on disk loads into a fresh model with finite weights.

    PYTHONPATH=src python bench/soak.py            # ~15-25 min on 2 loaded CPU cores
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "soak.json"
STEPS, SIGTERM_STEP, CHECKPOINT_EVERY = 200, 120, 20
QUICK = ["~experiment", "data.prompts_per_step=4", "data.group_size=4", "train.micro_batch_size=8", "train.grad_accum=2",
         "logging.progress_bar=false", "eval=off", "logging.plot=false", "server.enforce_eager=true",
         "server.kv_cache_gb=0.25", f"train.steps={STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
         "train.keep_checkpoints=20", "server.max_restarts=3"]


def session(fault: str, *extra: str) -> tuple[int, str, float]:
    """One train.py process; (exit code, output, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *QUICK, *extra], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, GRPO_FAULT=fault, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def flat(window_early: list[dict], window_late: list[dict]) -> dict[str, float]:
    """Median RSS and max open fds of two windows of one session."""
    def rss(w: list[dict]) -> float:
        return statistics.median(r["memory/rss_gb"] for r in w)

    return {"rss_gb_early_median": rss(window_early), "rss_gb_late_median": rss(window_late),
            "fds_early_max": max(r["proc/open_fds"] for r in window_early),
            "fds_late_max": max(r["proc/open_fds"] for r in window_late)}


def check_checkpoints(run_dir: Path, model_dir: str) -> list[int]:
    """Steps of every complete checkpoint, each loaded into a fresh model (finite weights)."""
    from transformers import AutoModelForCausalLM

    from grpo.trainer.checkpoint import CheckpointManager

    manager, loaded = CheckpointManager(run_dir), []
    for path in manager.checkpoints():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state = manager.load(path, model)
        assert all(torch.isfinite(p).all() for p in model.parameters()), path
        loaded.append(int(state["step"]))
    return loaded


def main() -> None:
    from grpo.models.tiny import build_model_dir

    model_dir = str(build_model_dir("tiny-qwen2", seed=0))
    run_dir = Path(tempfile.mkdtemp(prefix="grpo_soak_")) / "run"
    code1, out1, s1 = session(f"kill_server@50,100,150;sigterm@checkpoint_write:{SIGTERM_STEP}",
                              f"hydra.run.dir={run_dir}")
    assert code1 == 143, out1[-3000:]
    first = rows(run_dir)
    assert [r["step"] for r in first] == list(range(1, SIGTERM_STEP + 1)), "first session lost a step"
    # The resumed session: no hydra.run.dir (it continues in the run dir it resumes); step 150's kill only.
    code2, out2, s2 = session("kill_server@150", f"train.resume={run_dir}")
    assert code2 == 0, out2[-3000:]
    history = rows(run_dir)
    resumed_at = (SIGTERM_STEP - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # the last checkpoint before the stop
    assert [r["step"] for r in history] == list(range(1, STEPS + 1)), "a step lost or repeated"
    # Every server start of both sessions, in order: 2 (start, resume) + 3 restarts, one per kill.
    starts = re.findall(r"===== grpo: starting .* --model (\S+)", (run_dir / "logs" / "vllm.log").read_text(errors="replace"))
    second = history[resumed_at:]
    report = {
        "steps": STEPS, "server_kills_at": [50, 100, 150], "sigterm_in_checkpoint_write_of": SIGTERM_STEP,
        "resumed_from_checkpoint": resumed_at, "session_seconds": [s1, s2],
        "steps_exactly_once": True, "server_starts": len(starts),
        "session1": flat(first[20:50], first[SIGTERM_STEP - 30:SIGTERM_STEP]),
        "session2": flat(second[10:40], second[-30:]),
        "step_seconds_median": statistics.median(r["time/step_seconds"] for r in history),
        "checkpoints_loaded": check_checkpoints(run_dir, model_dir),
        "loadavg_end": os.getloadavg(), "run_dir": str(run_dir),
    }
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

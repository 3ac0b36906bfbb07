"""The openai-SDK calculator agent learns on the CPU: held-out accuracy with the tool against without it (docs/agents.md;
the figures: bench/README.md, "Agents: the calculator agent learns").

    python bench/agent_calculator.py [--seeds 0 1 2] [--steps 5] [--out bench/results/agent_calculator.json]
    python bench/agent_calculator.py --experiment smollm2_agent_calculator --steps 200 --eval-every 25 \
        --out bench/gpu/results/smollm2_agent_calculator.json        # one GPU: SmolLM2-135M-Instruct as the agent

For each seed (train.seed), one after the other (one vLLM server at a time): `python train.py
experiment=agent_calculator_warm` (model=warm_calc, built on first use) with the calculator agent
(grpo.tasks.agent_calculator:calculator_agent, the tool offered), then the same run with
`calculator_agent_without_tool` (the question alone, one request): the same warm start, steps, seeds and held-out
items. The held-out accuracy is the run's own evaluator's (grpo.pipeline.agent_eval: whole agent episodes, greedy
for eval/accuracy, 4 seeded samples each for eval/mean@k) at step 0 and every `--eval-every` steps.

A run whose directory under `--runs` already holds its last step's evaluation is read, not run again. Prints and
writes one JSON object: per run its eval curves, training reward and tool calls per step, seconds, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import ROOT, machine  # noqa: E402

ARMS = {"tool": "grpo.tasks.agent_calculator:calculator_agent",
        "no_tool": "grpo.tasks.agent_calculator:calculator_agent_without_tool"}


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _done(run_dir: Path, steps: int) -> bool:
    return any(r.get("step") == steps and r.get("eval/accuracy") is not None for r in _rows(run_dir))


def grpo_run(args: argparse.Namespace, seed: int, arm: str) -> dict:
    """One train.py run (or the one already in its directory); its curves and seconds."""
    run_dir = Path(args.runs) / f"{arm}_s{seed}"
    cmd = [sys.executable, str(ROOT / "train.py"), f"experiment={args.experiment}", f"data.rollout={ARMS[arm]}",
           f"train.steps={args.steps}", f"train.seed={seed}", f"eval.every={args.eval_every}",
           f"hydra.run.dir={run_dir}", "logging.plot=false"]
    seconds = None
    if not _done(run_dir, args.steps):
        t0 = time.monotonic()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "WANDB_MODE": "disabled"})
        seconds = round(time.monotonic() - t0, 1)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    rows = _rows(run_dir)
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    steps = [r for r in rows if r.get("reward/weighted") is not None]
    return {"arm": arm, "seed": seed, "command": " ".join(cmd[1:]),
            "eval_accuracy": {int(r["step"]): r["eval/accuracy"] for r in evals},
            "eval_mean_at_k": {int(r["step"]): round(r["eval/mean@k"], 3) for r in evals if "eval/mean@k" in r},
            "eval_seconds": [round(r["eval/seconds"], 1) for r in evals],
            "reward_per_step": [round(r["reward/weighted"], 3) for r in steps],
            "tool_calls_per_episode": [round(r["agent/tool_calls_mean"], 3) for r in steps],
            "rollout_errors": sum(r.get("agent/rollout_errors", 0) for r in steps),
            "seconds": seconds, "run_dir": str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="agent_calculator_warm",
                        help="the experiment run (smollm2_agent_calculator: the same comparison on one GPU)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed; each run once per arm")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--runs", default="/tmp/agent_calculator_runs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_calculator.json"))
    args = parser.parse_args()
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            runs.append(grpo_run(args, seed, arm))
            print(json.dumps(runs[-1]), flush=True)
    result = {"bench": "agent_calculator", "experiment": args.experiment, "steps": args.steps,
              "runs": runs, "machine": machine()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

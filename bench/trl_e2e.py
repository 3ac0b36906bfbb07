"""End to end against TRL's ``GRPOTrainer`` on the digits task: wall time per step and reward after N steps.

    python bench/trl_e2e.py [--steps 10]            # TRL side; ours is train.py (see bench/run_all.py)

TRL generates with transformers on this CPU (no vLLM: ``use_vllm=False``), ours with the vLLM CPU engine. Same tiny
model (tiny-qwen2, seed 0), same prompts source (``grpo.tasks.prompts.DigitsTask``: 8 random lowercase letters,
no chat template), same reward (``grpo.tasks.rewards.DigitFractionReward``: share of digit characters of the
decoded completion), 8 prompts x 8 completions per optimizer step (``per_device_train_batch_size=32``,
``gradient_accumulation_steps=2`` = our micro-batch 32 x 2), <= 16 new tokens, temperature 1, AdamW lr 1e-3
constant, grad clip 1.0, clip eps 0.2, no KL, token-mean loss (TRL ``loss_type="dapo"`` = our ``token_mean``),
full fine-tuning. Wall time per step comes from a callback's timestamps at each optimizer step's end (generation +
scoring + training); the reward is TRL's logged ``reward`` (mean over the step's 64 completions).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, loadavg, machine, max_rss_bytes, model_dir  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS / "trl_e2e.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.tasks.prompts import DigitsTask
    from grpo.tasks.rewards import DigitFractionReward

    mdir = model_dir("tiny")
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    rng = random.Random(0)
    prompts = [p.text for p in DigitsTask(8).sample(rng, 8 * args.steps)]
    reward = DigitFractionReward()

    def digits_reward(prompts, completions, **kw):
        return [reward(None, c) for c in completions]

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_begin(self, a, state, control, **kw):
            if not self.marks:
                self.marks.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            self.marks.append(time.perf_counter())

    clock = Clock()
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_e2e_"), per_device_train_batch_size=32,
        gradient_accumulation_steps=2, num_generations=8, max_completion_length=16, temperature=1.0, top_p=1.0,
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, loss_type="dapo", beta=0.0, epsilon=0.2,
        max_steps=args.steps, use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1,
        save_strategy="no", seed=0, use_vllm=False, disable_dropout=True, shuffle_dataset=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=digits_reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[clock])  # fmt: skip
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    rewards = [h["reward"] for h in logs]
    res = {
        "bench": "trl_e2e", "machine": machine(), "command": "python bench/trl_e2e.py " + " ".join(argv or sys.argv[1:]),
        "steps": args.steps, "wall_seconds": wall, "step_seconds": step_s,
        "median_step_s": statistics.median(step_s[1:] or step_s), "rewards": rewards,
        "reward_last": rewards[-1] if rewards else None,
        "reward_last3": statistics.mean(rewards[-3:]) if rewards else None,
        "trl_step_time": [h.get("step_time") for h in logs], "max_rss_gb": max_rss_bytes() / 1024**3,
        "loadavg_end": loadavg(), "trl": __import__("trl").__version__,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}))
    return res


if __name__ == "__main__":
    main()

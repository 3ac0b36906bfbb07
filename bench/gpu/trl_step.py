"""TRL's whole GRPO step on one GPU (vLLM colocate), for the side-by-side with train.py in bench/gpu/README.md.

    python bench/gpu/trl_step.py --preset qwen3b --steps 10 --out trl_qwen3b.json

A real ``trl.GRPOTrainer`` (TRL 1.16, ``use_vllm=True, vllm_mode="colocate"``: vLLM's ``LLM`` in the trainer's
process on the same GPU, weights copied into it after every optimizer step) on the same inputs as
``bash bench/gpu/run_suite.sh whole_step``'s train.py runs: the preset's random bf16 weights (the directory
``model.offline=<preset>`` builds), the digits task's prompts (``DigitsTask(8)``, no chat template) and reward
(``DigitFractionReward``), 8 prompts x 8 completions per optimizer step (``per_device_train_batch_size=16`` x
``gradient_accumulation_steps=4`` = our micro-batch 16 x 4), <= 128 new tokens, temperature 1, bf16 weights,
torch AdamW lr 1e-6 constant, grad clip 1.0, clip eps 0.2, no KL, token-mean loss (``loss_type="dapo"``),
gradient checkpointing, vLLM at 0.3 of the GPU with max model length 1024 and CUDA graphs (vLLM's default).
Differences TRL imposes: its vLLM importance-sampling correction (on by default) and its own weight copy into vLLM.

A step's seconds are the gaps between a callback's marks at each optimizer step's end (generation, scoring,
training, weight copy); the first step (vLLM warm-up, compile) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    """The command line (bench/gpu/run_plan.py's `trl_step` jobs are checked against it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--min-new-tokens", type=int, default=0,
                    help="no EOS before this many tokens (vLLM's min_tokens, transformers' min_new_tokens): the forced "
                         "long completions of experiment=qwen3b_long_completions")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--micro-batch", type=int, default=16, help="per_device_train_batch_size (x 64/it accumulated)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny preset on CPU, transformers' generate (no vLLM)")
    ap.add_argument("--optim", default="adamw_torch", help="transformers' optim (adamw_torch_fused = fused AdamW)")
    ap.add_argument("--no-gradient-checkpointing", action="store_true", help="keep activations (ours: "
                    "model.gradient_checkpointing=false)")
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    args = parser().parse_args()
    # vLLM's external launcher (TRL's colocate mode) joins a torch.distributed group: one process, rank 0.
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.models.tiny import build_model_dir
    from grpo.tasks.prompts import DigitsTask
    from grpo.tasks.rewards import DigitFractionReward

    gpu = not args.cpu_smoke
    dtype = torch.bfloat16 if gpu else torch.float32
    mdir = str(build_model_dir(args.preset, dtype=str(dtype).removeprefix("torch.")))
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    prompts = [p.text for p in DigitsTask(8).sample(random.Random(0), 8 * (args.steps + 1))]
    reward = DigitFractionReward()

    def digits_reward(prompts, completions, **kw):
        return [reward(None, c) for c in completions]

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = [time.perf_counter()]

        def on_step_end(self, a, state, control, **kw):
            sync()
            self.marks.append(time.perf_counter())

    clock = Clock()
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_step_"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=64 // args.micro_batch,
        num_generations=8, max_completion_length=args.max_new_tokens, temperature=1.0, learning_rate=1e-6,
        lr_scheduler_type="constant", optim=args.optim, weight_decay=0.0, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, loss_type="dapo", bf16=gpu, gradient_checkpointing=not args.no_gradient_checkpointing,
        max_steps=args.steps, seed=0,
        use_vllm=gpu, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_max_model_length=max(1024, args.max_new_tokens + 64), use_cpu=not gpu,
        generation_kwargs={"min_tokens" if gpu else "min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None,
        report_to=[], logging_steps=1, save_strategy="no", disable_dropout=True, shuffle_dataset=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=digits_reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[clock])  # fmt: skip
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    logs = [r for r in trainer.state.log_history if "loss" in r]
    steady = step_s[1:]
    tokens = [r.get("completions/mean_length", float("nan")) * 64 for r in logs]
    result = {
        "impl": "trl", "trl_version": __import__("trl").__version__, "vllm_version": __import__("vllm").__version__ if gpu else None,
        "preset": args.preset, "max_new_tokens": args.max_new_tokens, "min_new_tokens": args.min_new_tokens,
        "micro_batch": args.micro_batch, "gradient_checkpointing": cfg.gradient_checkpointing, "device": torch.cuda.get_device_name() if gpu else "cpu", "steps": args.steps,
        "first_step_s": step_s[0] if step_s else None, "step_s": step_s,
        "steady_step_s_mean": statistics.mean(steady) if steady else None,
        "steady_step_s_median": statistics.median(steady) if steady else None,
        "completion_tokens_per_step": tokens,
        "trained_tokens_per_s": statistics.mean(tokens[1:]) / statistics.mean(steady) if steady else None,
        "train_wall_s": wall, "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1024**3 if gpu else None,
        "log_history": logs,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "log_history"}))


if __name__ == "__main__":
    main()

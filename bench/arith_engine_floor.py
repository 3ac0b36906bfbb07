"""The vLLM CPU engine's own cost for one step of ``experiment=arith_grpo`` (16 prompts x 8 samples, <= 8 tokens,
T=1): ``LLM.generate`` in this process, no server, no HTTP, no sync, with and without a log-prob per sampled token.

    OMP_NUM_THREADS=1 python bench/arith_engine_floor.py --out bench/results/arith_engine_floor.json

Same engine settings as ``server=cpu`` (float32, 1 GiB KV cache, no chunked prefill, the worker in the engine
process, one OpenMP thread as the server gets on 2 cores), the prompts of steps 0..N-1 of seed 0, as our pipeline
draws them. It bounds what any design that generates with vLLM can reach on this machine: the TRL comparison's
target (ours at TRL's final accuracy in half TRL's seconds) needs <= 0.07 s per step of everything together
(bench/README.md, "Side by side with TRL's GRPOTrainer on the skill task").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per variant (after 5 warm-up steps)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # vLLM's CPU platform runs the worker in the engine process only with this off (as server=cpu arranges).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from grpo.recipes.warmstart import warmstart_path
    from grpo.tasks.arithmetic import ArithmeticTask

    llm = LLM(model=str(warmstart_path("warm-arith", 0)), dtype="float32", kv_cache_memory_bytes=2**30,
              max_model_len=1024, enable_chunked_prefill=False, distributed_executor_backend="uni", seed=0)
    tokenizer, task = llm.get_tokenizer(), ArithmeticTask()
    result: dict = {"machine": machine(), "omp_threads": os.environ.get("OMP_NUM_THREADS"), "variants": {}}
    for variant, logprobs in (("logprobs", 0), ("no_logprobs", None)):
        params = SamplingParams(n=8, max_tokens=8, temperature=1.0, top_p=1.0, detokenize=False, logprobs=logprobs)
        times, tokens = [], []
        for step in range(-5, args.steps):
            prompts = task.sample(random.Random(f"grpo-local:0:{max(step, 0)}"), 16)
            ids = [{"prompt_token_ids": tokenizer.encode(p.text, add_special_tokens=False)} for p in prompts]
            t0 = time.perf_counter()
            outs = llm.generate(ids, params, use_tqdm=False)
            if step >= 0:
                times.append(time.perf_counter() - t0)
                tokens.append(sum(len(o.token_ids) for r in outs for o in r.outputs))
        result["variants"][variant] = {"median_s": statistics.median(times), "mean_s": statistics.mean(times),
                                       "min_s": min(times), "tokens_per_step": statistics.mean(tokens)}
    result["load_after"] = os.getloadavg()
    print(json.dumps(result["variants"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""One step's generate call of ``experiment=arith_grpo`` (16 prompts x 8 samples, <= 8 new tokens, T=1, seeded)
through our server, one request per prompt (Atropos' form) against the batched /generate, alternated call by call.

    python bench/generate_overhead.py --out bench/results/generate_overhead.json

The server is started as train.py starts it (``VLLMServer`` with conf/server/cpu.yaml, the warm-arith model); the
prompts are those of seed 0's steps as ``LocalRolloutPipeline`` draws them. Besides each variant's seconds per call,
the engine steps each call took (vLLM's ``vllm:iteration_tokens_total`` count on /metrics): one request per prompt
reaches the engine over several of its steps, so prefills are split and more decode steps run. The same call on
vLLM's engine in-process, without a server, is ``bench/arith_engine_floor.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))


def engine_steps(url: str) -> float:
    """Engine steps the server has run so far (the count of vLLM's tokens-per-step histogram)."""
    import requests

    text = requests.get(url + "/metrics", timeout=10).text  # nan (no such line) under --disable-log-stats
    return float("nan") if "vllm:iteration_tokens_total_count" not in text else sum(float(v) for v in re.findall(r"^vllm:iteration_tokens_total_count\{[^}]*\} ([0-9.e+]+)", text, re.M))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="timed calls per variant (after 3 warm-up calls)")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra vLLM flag (server.extra_args)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from grpo.inference.client import InferenceClient
    from grpo.inference.process import VLLMServer
    from grpo.recipes.warmstart import warmstart_path
    from grpo.tasks.arithmetic import ArithmeticTask

    model = str(warmstart_path("warm-arith", 0))
    cfg = OmegaConf.load(ROOT / "conf" / "server" / "cpu.yaml")
    cfg.pop("defaults")
    cfg.served_model_aliases = []
    cfg.extra_args = list(args.server_arg)
    tokenizer, task = AutoTokenizer.from_pretrained(model), ArithmeticTask()
    server = VLLMServer(model, cfg, Path(tempfile.mkdtemp()) / "vllm.log")
    server.start()
    clients = {"per_prompt": InferenceClient(server.url, prompts_per_request=0), "batched": InferenceClient(server.url)}
    variants = [(f"{form}_{lp}", client, lp == "logprobs") for form, client in clients.items()
                for lp in ("logprobs", "no_logprobs")]
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    steps: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    try:
        for step in range(-3, args.steps):
            prompts = task.sample(random.Random(f"grpo-local:0:{max(step, 0)}"), 16)
            ids = [tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
            seed = (0 * 1_000_003 + max(step, 0)) % (2**31)  # LocalRolloutPipeline._sampling_seed of seed 0
            tokens = set()
            for name, client, logprobs in variants:
                before, t0 = engine_steps(server.url), time.perf_counter()
                out = client.generate(ids, n=8, max_tokens=8, temperature=1.0, detokenize=False, logprobs=logprobs,
                                      seed=seed)
                elapsed = time.perf_counter() - t0
                tokens.add(str([[c.token_ids for c in group] for group in out]))
                if step >= 0:
                    times[name].append(elapsed)
                    steps[name].append(engine_steps(server.url) - before)
            assert len(tokens) == 1, "the variants sampled different tokens for one seeded call"
    finally:
        server.stop()
    result = {"machine": machine(), "server_args": args.server_arg, "variants": {
        name: {"median_s": statistics.median(times[name]), "mean_s": statistics.mean(times[name]),
               "engine_steps_per_call": statistics.mean(steps[name])} for name in times}}
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

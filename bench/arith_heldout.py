"""Held-out accuracy of a model on the arithmetic skill task, through the real vLLM CPU engine.

    python bench/arith_heldout.py <model dir | run dir> [more ...] [--samples 8] [--temperature 1.0] [--out file.json]

A run dir means its latest complete checkpoint (``<run>/checkpoints/step_*/`` with ``COMPLETE``). For each model it
starts our vLLM server (``grpo.inference.process.VLLMServer``) on a free port, asks for greedy completions of the
task's 500 held-out prompts (``ArithmeticTask.eval_prompts()``), scores them with ``ArithmeticCorrectReward``, and,
with ``--samples N``, draws N samples per prompt at ``--temperature`` for the pass rate and the share of groups whose
rewards differ (what GRPO can learn from). Prints one JSON line per model; ``--out`` also writes them to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import free_port, machine  # noqa: E402


def resolve(path: str) -> Path:
    """A model directory, or the latest complete checkpoint of a run directory."""
    p = Path(path).expanduser().resolve()
    if (p / "config.json").exists():
        return p
    steps = sorted(d for d in (p / "checkpoints").glob("step_*") if (d / "COMPLETE").exists())
    if not steps:
        raise SystemExit(f"{p} is neither a model directory (config.json) nor a run dir with complete checkpoints")
    return steps[-1]


def evaluate(model_dir: Path, samples: int, temperature: float, max_new_tokens: int = 8) -> dict:
    """Greedy held-out accuracy (and sampled pass rate) of `model_dir` served by the vLLM CPU engine."""
    from transformers import AutoTokenizer

    from grpo.inference.client import InferenceClient
    from grpo.inference.process import VLLMServer
    from grpo.schema import ServerConfig
    from grpo.tasks.arithmetic import ArithmeticCorrectReward, ArithmeticTask

    task, reward = ArithmeticTask(), ArithmeticCorrectReward()
    heldout = task.eval_prompts()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.encode(p.text, add_special_tokens=False) for p in heldout]
    cfg = ServerConfig(host="127.0.0.1", port=free_port(), kv_cache_gb=0.25, max_model_len=512,
                       dtype="float32", startup_timeout_s=300, busy_loop_s=0.02)
    log = Path(tempfile.mkdtemp(prefix="arith_heldout_")) / "vllm.log"
    server = VLLMServer(model_dir, cfg, log, served_model_name=str(model_dir))
    t0 = time.monotonic()
    server.start()
    client = InferenceClient(server.url)
    try:
        start_s = time.monotonic() - t0
        t1 = time.monotonic()
        greedy = client.generate(ids, n=1, max_tokens=max_new_tokens, temperature=0.0, model=str(model_dir))
        right = [reward(p, tok.decode(c[0].token_ids, skip_special_tokens=True)) for p, c in zip(heldout, greedy)]
        out = {"model": str(model_dir), "heldout_items": len(heldout), "greedy_accuracy": sum(right) / len(right),
               "server_start_s": round(start_s, 1), "greedy_s": round(time.monotonic() - t1, 1)}
        if samples:
            t2 = time.monotonic()
            groups = client.generate(ids, n=samples, max_tokens=max_new_tokens, temperature=temperature,
                                     model=str(model_dir), seed=0)
            scores = [[reward(p, tok.decode(c.token_ids, skip_special_tokens=True)) for c in g]
                      for p, g in zip(heldout, groups)]
            flat = [s for g in scores for s in g]
            out.update({"temperature": temperature, "samples_per_prompt": samples,
                        "sampled_pass_rate": sum(flat) / len(flat),
                        "groups_with_variance": sum(max(g) != min(g) for g in scores) / len(scores),
                        "sampled_s": round(time.monotonic() - t2, 1)})
        return out
    finally:
        client.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="model directories or run directories")
    parser.add_argument("--samples", type=int, default=0, help="samples per prompt for the pass rate (0: greedy only)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="also write the JSON lines here")
    args = parser.parse_args()
    rows = []
    for m in args.models:
        row = {**evaluate(resolve(m), args.samples, args.temperature), "machine": machine()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()

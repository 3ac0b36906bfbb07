"""Where the whole step's generation time goes: our server's /generate against vLLM's in-process ``LLM`` (TRL's
colocate layout), seeded and unseeded, on the whole-step workload.

    python bench/gpu/gen_probe.py --preset qwen3b --rounds 5 --out gen_probe.json

The workload is one step of ``bash bench/gpu/run_suite.sh whole_step``: the digits task's 8 prompts x 8 samples,
128 new tokens (``ignore_eos``: every sample has exactly that many), temperature 1, one log-prob per token from the
processed (post-temperature) distribution. Both engines hold the preset's random bf16 weights at
``--kv-share`` of the GPU each, CUDA graphs on, and run side by side on one GPU; each round times every variant once
in a rotating order, with a pause after each (an idle engine's busy-poll must not fall on the next measurement):

- ``server_seeded`` / ``server_unseeded``: ``InferenceClient.generate`` against ``python -m grpo.inference.server``
  (what ``data.seeded_sampling=true|false`` sends: a base seed per call, or none), ``detokenize=False`` as the local
  pipeline sends it (it decodes the token ids itself); ``server_unseeded_detok``: the same with the server
  detokenizing (the pipeline's requests before 2026-11-25);
- ``inproc_unseeded`` / ``inproc_seeded``: ``LLM.generate`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
  the engine core runs here, as in TRL's colocate mode), one request per prompt with ``n=8``.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ROOT, free_port, machine, model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-share", type=float, default=0.3)
    ap.add_argument("--gap-s", type=float, default=1.5)
    ap.add_argument("--dtype", default="bfloat16", help="float32 for a CPU smoke run of --preset tiny")
    ap.add_argument("--variants", nargs="*", default=None, help="a subset of the variants (default: all)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by the in-process LLM only; the server gets its own env
    sys.path.insert(0, str(ROOT / "src"))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from grpo.inference.client import InferenceClient
    from grpo.inference.process import VLLMServer
    from grpo.pipeline.tasks import DigitsTask

    mdir = model_dir(args.preset)
    tok = AutoTokenizer.from_pretrained(mdir)
    ids = [tok.encode(p.text, add_special_tokens=False) for p in DigitsTask(8).sample(random.Random(0), 8)]
    log = Path(tempfile.mkdtemp(prefix="gen_probe_")) / "server.log"
    cfg = {"host": "127.0.0.1", "port": free_port(), "gpu_memory_utilization": args.kv_share, "max_model_len": 1024,
           "dtype": args.dtype, "enforce_eager": None, "startup_timeout_s": 900, "extra_args": []}  # fmt: skip
    server = VLLMServer(mdir, cfg, log, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    server.start()
    try:
        client = InferenceClient(server.url)
        in_process = not args.variants or any(v.startswith("inproc") for v in args.variants)
        llm = LLM(str(mdir), gpu_memory_utilization=args.kv_share, max_model_len=1024, dtype=args.dtype,
                  logprobs_mode="processed_logprobs", seed=0) if in_process else None  # fmt: skip
        sampling = dict(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True, logprobs=0)

        def server_run(seed, detokenize=False):
            extra = {} if seed is None else {"seed": seed}
            outs = client.generate(ids, n=8, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True,
                                   detokenize=detokenize, **extra)  # fmt: skip
            return sum(len(c.token_ids) for o in outs for c in o)

        def inproc_run(seed):
            params = [SamplingParams(n=8, **sampling, seed=None if seed is None else seed + 8 * i)
                      for i in range(len(ids))]  # fmt: skip
            outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        variants = {
            "server_seeded": lambda r: server_run(1000 + r), "server_unseeded": lambda r: server_run(None),
            "server_unseeded_detok": lambda r: server_run(None, detokenize=True),
            "inproc_seeded": lambda r: inproc_run(1000 + r), "inproc_unseeded": lambda r: inproc_run(None),
        }  # fmt: skip
        variants = {k: v for k, v in variants.items() if not args.variants or k in args.variants}
        for fn in variants.values():  # warm-up: first requests pay for lazy initialisation
            fn(-1)
        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                tokens = variants[name](r)
                times[name].append(time.perf_counter() - t0)
                assert tokens == 64 * args.max_tokens, (name, tokens)
                time.sleep(args.gap_s)
        result = {
            "machine": machine(), "args": vars(args), "tokens_per_round": 64 * args.max_tokens,
            "seconds": times, "median_s": {k: statistics.median(v) for k, v in times.items()},
            # vLLM logs its engine config at start-up: whether async scheduling (host work beside the GPU's) is on.
            "server_log_scheduling": [ln.strip()[-300:] for ln in log.read_text(errors="replace").splitlines()
                                      if re.search(r"async(hronous)?[ _]scheduling", ln, re.I)][:3],
        }  # fmt: skip
        print(json.dumps(result["median_s"], indent=1))
        Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        server.stop()


if __name__ == "__main__":
    main()

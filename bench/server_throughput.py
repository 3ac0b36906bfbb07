"""Rollout throughput: our inference server (vLLM + GRPO middleware + worker extension) vs a plain vLLM server.

    python bench/server_throughput.py [--model tiny] [--rounds 4] [--prompts 8] [--n 8] [--max-tokens 64]

Both servers run at once on free ports with the same engine settings as ``conf/server/cpu.yaml`` (float32,
``--gpu-memory-utilization 0.2``, ``--max-model-len 1024``): ours through ``grpo.inference.process.VLLMServer``
(``python -m grpo.inference.server``), the plain one as ``python -m vllm.entrypoints.openai.api_server``. Each round
sends the same workload (``--prompts`` token-id prompts, ``n`` samples each, ``max_tokens`` with ``ignore_eos`` so
every sample has exactly that many tokens, temperature 1, one log-prob per token) to:

- ``ours_generate``: our ``POST /generate`` (what the trainer and Atropos environments call),
- ``ours_completions``: our server's ``/v1/completions`` (vLLM's own route through our middleware),
- ``plain_completions``: the plain server's ``/v1/completions``,

in an order that rotates every round (so all three see the same machine load). Throughput = generated tokens /
wall seconds of the round (prompts sent concurrently). The ratio is ours / plain on the median of the rounds.
A pause (``--gap-s``, 1.5 s) follows each measurement: an idle vLLM worker busy-polls for up to 1 s after its last
message (ours is capped by ``--busy-loop-s``, as ``conf/server/cpu.yaml`` does), and without the pause that tail of one
server would fall on the next server's measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, free_port, loadavg, machine, model_dir  # noqa: E402

SERVER_ARGS = ["--max-model-len", "1024", "--disable-uvicorn-access-log"]


class PlainServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group (stopped by its pgid only)."""

    def __init__(self, model: Path, log: Path, extra: list[str] = (), kv_share: float = 0.2, dtype: str = "float32",
                 env: dict | None = None):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--gpu-memory-utilization", str(kv_share),
                    "--dtype", dtype, *SERVER_ARGS, *extra]  # fmt: skip
        self.log = log
        self.env = env or {}

    def start(self, timeout: float = 600):
        env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn", **self.env)
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"plain vLLM server exited: see {self.log}")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"plain vLLM server not healthy after {timeout}s; see {self.log}")

    def stop(self):
        if getattr(self, "proc", None) and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def prompts(k: int, length: int = 24) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(k)]


def run_round(url: str, route: str, model: str, ps: list[list[int]], n: int, max_tokens: int) -> dict:
    def one(p):
        common = {"n": n, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True, "seed": None}
        if route == "generate":
            body = {"prompt": {"prompt_token_ids": p}, "logprobs": 0, **common}
            r = requests.post(url + "/generate", json=body, timeout=600)
            r.raise_for_status()
            return sum(len(x) for x in r.json()["logprobs"])
        body = {"model": model, "prompt": p, "logprobs": 0, **common}
        r = requests.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return sum(len(c["logprobs"]["tokens"]) for c in r.json()["choices"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(ps)) as pool:
        toks = sum(pool.map(one, ps))
    wall = time.perf_counter() - t0
    return {"tokens": toks, "seconds": wall, "tokens_per_s": toks / wall, "loadavg": loadavg()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-share", type=float, default=0.2,
                    help="--gpu-memory-utilization of both servers (on CPU: share of RAM for the KV cache)")
    ap.add_argument("--dtype", default="float32", help="both servers' --dtype (bfloat16 on a GPU)")
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--gap-s", type=float, default=1.5, help="pause after each measurement (servers go idle)")
    ap.add_argument("--busy-loop-s", type=float, default=0.02,
                    help="our server's server.busy_loop_s (conf/server/cpu.yaml: 0.02; gpu.yaml: null = vLLM's 1 s); "
                         "negative = null")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS / "server_throughput.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from grpo.inference.process import VLLMServer

    mdir = model_dir(args.model)
    logdir = Path(tempfile.mkdtemp(prefix="bench_server_"))
    cfg = {"host": "127.0.0.1", "port": free_port(), "gpu_memory_utilization": args.kv_share, "max_model_len": 1024,
           "dtype": args.dtype, "enforce_eager": None, "startup_timeout_s": 600, "extra_args": [],
           "busy_loop_s": args.busy_loop_s if args.busy_loop_s >= 0 else None}  # fmt: skip
    ours = VLLMServer(mdir, cfg, logdir / "ours.log")
    plain = PlainServer(mdir, logdir / "plain.log", kv_share=args.kv_share, dtype=args.dtype)
    t0 = time.perf_counter()
    ours.start()
    t_ours = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        plain.start()
        t_plain = time.perf_counter() - t0
        ps = prompts(args.prompts, args.prompt_tokens)
        targets = {"ours_generate": (ours.url, "generate"), "ours_completions": (ours.url, "completions"),
                   "plain_completions": (plain.url, "completions")}  # fmt: skip
        for url, route in targets.values():  # warm-up
            run_round(url, route, str(mdir), ps[:2], 2, 8)
        rounds: dict[str, list[dict]] = {k: [] for k in targets}
        names = list(targets)
        for r in range(args.rounds):
            order = names[r % 3:] + names[: r % 3]
            for name in order:
                url, route = targets[name]
                res = run_round(url, route, str(mdir), ps, args.n, args.max_tokens)
                rounds[name].append(res)
                # Let the server just used go idle (vLLM's worker busy-polls for up to 1 s after its last
                # message) so its tail does not land on the next measurement.
                time.sleep(args.gap_s)
                print(f"  round {r} {name:18} {res['tokens_per_s']:8.1f} tok/s ({res['seconds']:.2f}s, load "
                      f"{res['loadavg']:.1f})", flush=True)  # fmt: skip
    finally:
        plain.stop()
        ours.stop()
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in rounds.items()}
    result = {
        "bench": "server_throughput", "machine": machine(),
        "command": "python bench/server_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "workload": {"gap_s": args.gap_s, "model": args.model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "n": args.n,
                     "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0},
        "server_args": SERVER_ARGS + ["--dtype", args.dtype, "--gpu-memory-utilization", str(args.kv_share)], "ours_extra": "--logprobs-mode processed_logprobs --worker-extension-cls ... --middleware ...", "ours_busy_loop_s": cfg["busy_loop_s"],
        "startup_seconds": {"ours": t_ours, "plain": t_plain},
        "median_tokens_per_s": med,
        "ratio_generate_vs_plain": med["ours_generate"] / med["plain_completions"],
        "ratio_completions_vs_plain": med["ours_completions"] / med["plain_completions"],
        # Paired: each round's ours/plain ratio (the targets of a round run back to back), then the median.
        "paired_ratio_generate_vs_plain": statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds["ours_generate"], rounds["plain_completions"])),
        "paired_ratio_completions_vs_plain": statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds["ours_completions"], rounds["plain_completions"])),
        "rounds": rounds,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


def table(result: dict) -> str:
    m = result["median_tokens_per_s"]
    return "\n".join([
        "| server / route | generated tok/s (median) | ratio vs plain |", "|---|---|---|",
        f"| ours POST /generate | {m['ours_generate']:.1f} | {result['ratio_generate_vs_plain']:.3f} "
        f"(paired median {result['paired_ratio_generate_vs_plain']:.3f}) |",
        f"| ours /v1/completions | {m['ours_completions']:.1f} | {result['ratio_completions_vs_plain']:.3f} "
        f"(paired median {result['paired_ratio_completions_vs_plain']:.3f}) |",
        f"| plain vLLM /v1/completions | {m['plain_completions']:.1f} | 1.000 |",
    ])


if __name__ == "__main__":
    main()

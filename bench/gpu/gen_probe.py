"""Where the whole step's generation time goes: our server's /generate against vLLM's in-process ``LLM`` (TRL's
colocate layout), seeded and unseeded, on the whole-step workload.

    python bench/gpu/gen_probe.py --preset qwen3b --rounds 5 --out gen_probe.json
    python bench/gpu/gen_probe.py --preset smollm2-135m --workload chat_arith --dtype float32 --max-tokens 48 --out x.json

The workload is one step of ``bash bench/gpu/run_suite.sh whole_step``: the digits task's 8 prompts x 8 samples,
128 new tokens (``ignore_eos``: every sample has exactly that many), temperature 1, one log-prob per token from the
processed (post-temperature) distribution. Both engines hold the preset's random bf16 weights at
``--kv-share`` of the GPU each, CUDA graphs on, and run side by side on one GPU; each round times every variant once
in a rotating order, with a pause after each (an idle engine's busy-poll must not fall on the next measurement).
``--workload chat_arith`` takes one step of ``experiment=smollm2_chat_arith_shared`` instead: its 32 chat prompts
(``data=chat_arith``, the model's chat template) x 8 samples, ``--max-tokens`` each (``ignore_eos``, as above).

- ``server_seeded`` / ``server_unseeded``: ``InferenceClient.generate`` against ``python -m grpo.inference.server``
  (what ``data.seeded_sampling=true|false`` sends: a base seed per call, or none), ``detokenize=False`` as the local
  pipeline sends it (it decodes the token ids itself); ``server_unseeded_detok``: the same with the server
  detokenizing (the pipeline's requests before 2026-11-25); ``server_unseeded_nologprobs``: no log-probs asked
  (`data.rollout_logprobs=false`);
- ``inproc_unseeded`` / ``inproc_seeded``: ``LLM.generate`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
  the engine core runs here, as in TRL's colocate mode), one request per prompt with ``n=8``;
  ``inproc_unseeded_nologprobs``: the same without the per-token log-prob (what log-probs cost the engine).

``--profile`` then runs ``inproc_unseeded`` once more under ``torch.profiler`` (the engine core and model runner
run in this process) and reports the GPU's busy time (the sum of its kernels) against the wall time of the call:
near 1 the decode is GPU-bound, well below 1 the host's per-step work sets the pace. ``--gpu-util`` samples
``nvidia-smi``'s utilisation every 50 ms and reports its mean inside each timed call. ``--py-spy SECONDS`` samples
the server's processes (API server and engine core) with py-spy while ``server_unseeded`` calls run back to back,
then ``server_unseeded_nologprobs`` calls: where the host's per-step work goes, per process, with and without
log-probs. ``--server-arg=ARG`` (repeatable) passes ARG to the server's vLLM (e.g. ``--server-arg=--disable-log-stats``).
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
from pyspy_stacks import finish_recording, start_recording  # noqa: E402

from common import ROOT, free_port, machine, model_dir  # noqa: E402

VARIANTS = ("server_seeded", "server_unseeded", "server_unseeded_detok", "server_unseeded_flat",
            "server_unseeded_nologprobs", "inproc_seeded", "inproc_unseeded", "inproc_unseeded_nologprobs",
            "inproc_unseeded_nodetok")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3b", help="a bench preset, a real-size one, or smollm2-135m (packaged)")
    ap.add_argument("--workload", choices=["digits", "chat_arith"], default="digits")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per step (8 samples each); default: the workload's own (8 digits, 32 chat_arith)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-share", type=float, default=0.3)
    ap.add_argument("--gap-s", type=float, default=1.5)
    ap.add_argument("--dtype", default="bfloat16", help="float32 for a CPU smoke run of --preset tiny")
    ap.add_argument("--variants", nargs="*", default=None, choices=VARIANTS,
                    help="a subset of the variants (default: all)")
    ap.add_argument("--profile", action="store_true", help="GPU busy time vs wall of one in-process call")
    ap.add_argument("--gpu-util", action="store_true", help="nvidia-smi utilisation sampled during each call")
    ap.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                    help="sample the server's processes with py-spy for SECONDS per log-probs setting")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra vLLM argument for the server (repeatable; write --server-arg=--flag)")
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    args = parser().parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by the in-process LLM only; the server gets its own env
    sys.path.insert(0, str(ROOT / "src"))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from grpo.inference.client import InferenceClient
    from grpo.inference.process import VLLMServer
    mdir = model_dir(args.preset)
    tok = AutoTokenizer.from_pretrained(mdir)
    ids = [tok.encode(p.text, add_special_tokens=False) for p in workload_prompts(args.workload, tok, args.prompts)]
    tokens_per_round = 8 * len(ids) * args.max_tokens
    log = Path(tempfile.mkdtemp(prefix="gen_probe_")) / "server.log"
    cfg = {"host": "127.0.0.1", "port": free_port(), "gpu_memory_utilization": args.kv_share, "max_model_len": 1024,
           "dtype": args.dtype, "enforce_eager": None, "startup_timeout_s": 900, "extra_args": []}  # fmt: skip
    trace_dir = Path(tempfile.mkdtemp(prefix="gen_probe_trace_"))
    if args.profile:  # inert until POST /start_profile
        profiler = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False,
                    "ignore_frontend": True}  # fmt: skip
        cfg["extra_args"] = ["--profiler-config", json.dumps(profiler)]
    cfg["extra_args"] += list(args.server_arg)
    server = VLLMServer(mdir, cfg, log, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    server.start()
    try:
        client = InferenceClient(server.url)
        in_process = not args.variants or any(v.startswith("inproc") for v in args.variants)
        llm = LLM(str(mdir), gpu_memory_utilization=args.kv_share, max_model_len=1024, dtype=args.dtype,
                  logprobs_mode="processed_logprobs", seed=0) if in_process else None  # fmt: skip
        sampling = dict(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True, logprobs=0)

        def server_run(seed, detokenize=False, **more):
            extra = ({} if seed is None else {"seed": seed}) | more
            outs = client.generate(ids, n=8, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True,
                                   detokenize=detokenize, **extra)  # fmt: skip
            return sum(len(c.token_ids) for o in outs for c in o)

        def inproc_run(seed, logprobs=True, detokenize=True):
            lp = ({} if logprobs else {"logprobs": None}) | ({} if detokenize else {"detokenize": False})
            params = [SamplingParams(n=8, **{**sampling, **lp}, seed=None if seed is None else seed + 8 * i)
                      for i in range(len(ids))]  # fmt: skip
            outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        variants = {
            "server_seeded": lambda r: server_run(1000 + r), "server_unseeded": lambda r: server_run(None),
            "server_unseeded_detok": lambda r: server_run(None, detokenize=True),
            "server_unseeded_flat": lambda r: server_run(None, flat_logprobs=True),
            "server_unseeded_nologprobs": lambda r: server_run(None, logprobs=False),
            "inproc_seeded": lambda r: inproc_run(1000 + r), "inproc_unseeded": lambda r: inproc_run(None),
            "inproc_unseeded_nologprobs": lambda r: inproc_run(None, logprobs=False),
            "inproc_unseeded_nodetok": lambda r: inproc_run(None, detokenize=False),
        }  # fmt: skip
        assert tuple(variants) == VARIANTS, "VARIANTS (the --variants choices) must name every variant"
        variants = {k: v for k, v in variants.items() if not args.variants or k in args.variants}
        for fn in variants.values():  # warm-up: first requests pay for lazy initialisation
            fn(-1)
        times: dict[str, list[float]] = {k: [] for k in variants}
        windows: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        sampler = start_gpu_util_sampler() if args.gpu_util else None
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                tokens = variants[name](r)
                times[name].append(time.perf_counter() - t0)
                windows[name].append((time.time() - times[name][-1], time.time()))
                assert tokens == tokens_per_round, (name, tokens)
                time.sleep(args.gap_s)
        result = {
            "machine": machine(), "args": vars(args), "tokens_per_round": tokens_per_round,
            "seconds": times, "median_s": {k: statistics.median(v) for k, v in times.items()},
            # vLLM logs its engine config at start-up: whether async scheduling (host work beside the GPU's) is on.
            "server_log_scheduling": [ln.strip()[-300:] for ln in log.read_text(errors="replace").splitlines()
                                      if re.search(r"async(hronous)?[ _]scheduling", ln, re.I)][:3],
        }  # fmt: skip
        if sampler is not None:
            result["gpu_util_mean"] = gpu_util_in_windows(sampler, windows)
        if args.profile and llm is not None:
            result["profile"] = profile_call(lambda: inproc_run(None), tokens_per_round)
        if args.profile:
            result["server_profile"] = profile_server(server.url, lambda: server_run(None), trace_dir)
            print(json.dumps({k: v for k, v in result["server_profile"].items() if k != "top_cpu_ops"}, indent=1))
        if args.py_spy > 0:
            result["py_spy"] = {
                name: py_spy_server(server.pid, fn, args.py_spy, Path(args.out).with_suffix(f".{name}.pyspy.txt"))
                for name, fn in (("logprobs", lambda: server_run(None)),
                                 ("nologprobs", lambda: server_run(None, logprobs=False)))
            }  # fmt: skip
        print(json.dumps({k: v for k, v in result.items() if k in ("median_s", "gpu_util_mean")}, indent=1))
        if "profile" in result:
            print(json.dumps({k: v for k, v in result["profile"].items() if not k.startswith("table")}, indent=1))
        Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        server.stop()


def workload_prompts(workload: str, tokenizer, prompts: int | None = None) -> list:
    """One step's prompts: the whole-step digits task (8 prompts) or the real-model chat arithmetic task (32), or
    `prompts` of either."""
    from grpo.tasks.chat_arithmetic import ChatArithmeticTask
    from grpo.tasks.prompts import DigitsTask

    if workload == "digits":
        return DigitsTask(8).sample(random.Random(0), prompts or 8)
    task = ChatArithmeticTask(question="What is {expression}? Reply with the final number only.",
                              system_prompt="You are a helpful assistant.", min_digits=1, max_digits=2,
                              operators="+-")  # fmt: skip
    task.bind_tokenizer(tokenizer)
    return task.sample(random.Random(0), prompts or 32)


def start_gpu_util_sampler():
    """nvidia-smi printing "<unix ms>,<util %>" every 50 ms into a temporary file (stopped by gpu_util_in_windows)."""
    import subprocess

    path = Path(tempfile.mkdtemp(prefix="gpu_util_")) / "util.csv"
    cmd = ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "50"]
    return subprocess.Popen(cmd, stdout=path.open("w"), stderr=subprocess.DEVNULL), path


def gpu_util_in_windows(sampler, windows: dict) -> dict:
    """Mean utilisation of the samples that fall inside each variant's timed calls."""
    from datetime import datetime

    proc, path = sampler
    proc.terminate()
    proc.wait(10)
    samples = []
    for line in path.read_text().splitlines():
        try:
            stamp, util = line.rsplit(",", 1)
            samples.append((datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(util)))
        except ValueError:
            continue
    out = {}
    for name, spans in windows.items():
        inside = [u for t, u in samples if any(a <= t <= b for a, b in spans)]
        out[name] = {"mean": statistics.mean(inside) if inside else None, "samples": len(inside)}
    return out


def profile_server(url: str, fn, trace_dir: Path) -> dict:
    """One server call under vLLM's own torch profiler (engine core + model runner): the GPU's kernel time against
    the span of the engine's steps, and the engine process's heaviest CPU ops."""
    import gzip
    from collections import Counter

    import requests

    requests.post(url + "/start_profile", timeout=60).raise_for_status()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    requests.post(url + "/stop_profile", timeout=300).raise_for_status()
    time.sleep(5)
    files = sorted(trace_dir.rglob("*.json*"), key=lambda f: f.stat().st_size)
    if not files:
        return {"wall_s": wall, "error": f"no trace in {trace_dir}"}
    raw = files[-1].read_bytes()
    trace = json.loads(gzip.decompress(raw) if files[-1].suffix == ".gz" else raw)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    cpu_ops = Counter()
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function", "cuda_runtime"):
            cpu_ops[f"{e.get('cat')}:{e['name'][:70]}"] += e["dur"]
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e6 if kernels else None
    return {
        "wall_s": wall, "trace_files": [f.name for f in files], "kernel_s": sum(e["dur"] for e in kernels) / 1e6,
        "kernel_span_s": span, "kernels": len(kernels),
        "top_cpu_ops": [(k, round(v / 1e3, 2)) for k, v in cpu_ops.most_common(40)],
    }  # fmt: skip


def py_spy_server(pid: int | None, fn, seconds: float, raw_path: Path) -> dict:
    """The server's process tree sampled by py-spy while `fn` runs back to back for `seconds`: per process, where its
    samples go (bench/gpu/pyspy_stacks.py). The raw collapsed stacks stay in `raw_path`."""
    rec = start_recording(pid, raw_path, rate=250) if pid is not None else None
    calls = 0
    if rec is not None:
        time.sleep(1.0)  # py-spy attaches before the calls begin
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and rec.proc.poll() is None:
            fn()
            calls += 1
    # The calls are over: stop the recording now (a window of 0 s from its start has passed).
    return {"calls": calls, "raw": raw_path.name, **finish_recording(rec, raw_path, 0.0)}


def profile_call(fn, expected_tokens: int) -> dict:
    """One call under torch.profiler: the sum of GPU kernel time against the call's wall time, and the top tables."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        tokens = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    assert tokens == expected_tokens, tokens
    avg = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    return {
        "wall_s": wall, "gpu_kernel_s": kernel_us / 1e6, "gpu_busy_fraction": kernel_us / 1e6 / wall,
        "table_gpu": avg.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60),
        "table_cpu": avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
    }  # fmt: skip


if __name__ == "__main__":
    main()

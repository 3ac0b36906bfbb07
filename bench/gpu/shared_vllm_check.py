"""shared_vllm on a real GPU: one copy of the weights, trained in place under the running vLLM.

    python bench/gpu/shared_vllm_check.py --preset tiny-qwen2 --out results/shared_tiny.json
    python bench/gpu/shared_vllm_check.py --preset qwen3b --out results/shared_qwen3b.json

Checks and measures, in one process beside one vLLM server (CUDA graphs left on):
1. the trainer attaches to vLLM's tensors (SharedMemorySync.load_model) and every parameter is a view;
2. trainer vs vLLM log-probs of a fixed sequence agree (mean |diff|), before and after an optimizer step;
3. one optimizer step changes what vLLM generates (greedy completion before vs after);
4. device memory: used after the server started, after attaching (shared: ~no growth), and after loading the
   same model the usual way (mode=none: one more full copy).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def device_used_gb() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1024**3


def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                              capture_output=True, text=True, timeout=20).stdout
    except Exception as e:  # noqa: BLE001 - informational only
        return f"nvidia-smi failed: {e}"


def trainer_logprobs(model, tokens: list[int]) -> list[float]:
    from grpo.trainer.logprobs import token_logprobs

    ids = torch.tensor([tokens], device="cuda")
    labels = ids.clone()[:, 1:]
    with torch.no_grad():
        lp = token_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), labels, torch.ones(1, device="cuda"))
    return lp[0].float().tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny-qwen2")
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=9301)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.inference.client import InferenceClient
    from grpo.models.tiny import build_model_dir
    from grpo.serving.session import ServerSession
    from grpo.sync.base import SyncContext
    from grpo.sync.shared_memory import SharedMemorySync

    res: dict = {"preset": args.preset, "gpu": torch.cuda.get_device_name(0)}
    t0 = time.perf_counter()
    model_dir = build_model_dir(args.preset, seed=0, dtype="bfloat16")
    res["build_model_s"] = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(model_dir)
    server_cfg = OmegaConf.load(ROOT / "conf/server/gpu.yaml")
    server_cfg.pop("defaults")
    server_cfg.port = args.port
    server_cfg.gpu_memory_utilization = args.gpu_memory_utilization
    server_cfg.max_model_len = 1024
    server_cfg.served_model_aliases = []  # conf's default interpolates model.name, which this lone node lacks
    run_dir = Path(args.out).with_suffix("")
    run_dir.mkdir(parents=True, exist_ok=True)
    res["device_used_gb_before_server"] = device_used_gb()

    sync = SharedMemorySync()
    ctx = SyncContext(run_dir=run_dir, model_dir=Path(model_dir), server_cfg=server_cfg, tokenizer=tok)
    session = ServerSession(sync, ctx)
    try:
        t0 = time.perf_counter()
        session.launch()
        res["server_start_s"] = time.perf_counter() - t0
        res["device_used_gb_after_server"] = device_used_gb()
        t0 = time.perf_counter()
        model = sync.load_model(ctx)
        res["attach_s"] = time.perf_counter() - t0
        res["device_used_gb_after_attach"] = device_used_gb()
        n_params = sum(p.numel() for p in model.parameters())
        res["params_b"] = n_params / 1e9
        res["weights_gb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024**3
        res["nvidia_smi_after_attach"] = nvidia_smi()

        client = InferenceClient(sync.server.url)
        prompt = tok("The quick brown fox jumps over")["input_ids"]
        seq = prompt + tok(" the lazy dog 12345")["input_ids"]

        def greedy() -> list[int]:
            return client.generate([prompt], n=1, max_tokens=24, temperature=0.0, top_p=1.0)[0][0].token_ids

        def alignment() -> float:
            server = client.prompt_logprobs(seq)
            mine = trainer_logprobs(model, seq)
            return sum(abs(a - b) for a, b in zip(server, mine)) / len(mine)

        res["greedy_before"] = greedy()
        res["logprob_mad_before"] = alignment()

        # One optimizer step on a real objective: raise the log-likelihood of `seq`.
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr)
        torch.cuda.reset_peak_memory_stats()
        ids = torch.tensor([seq], device="cuda")
        t0 = time.perf_counter()
        from grpo.trainer.logprobs import token_logprobs

        lp = token_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), ids[:, 1:], torch.ones(1, device="cuda"))
        (-lp.mean()).backward()
        sync.before_optimizer_step()
        opt.step()
        sync.after_optimizer_step()
        metrics = sync.sync(model, 1)
        res["train_step_s"] = time.perf_counter() - t0
        res["sync"] = metrics
        res["trainer_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1024**3
        res["greedy_after"] = greedy()
        res["generation_changed"] = res["greedy_after"] != res["greedy_before"]
        res["logprob_mad_after"] = alignment()
        served_version = client.weight_version()
        res["served_weight_version"] = served_version
        del opt, lp
        torch.cuda.empty_cache()

        # mode=none keeps a second full copy in the trainer: load the same weights the usual way and measure.
        before = device_used_gb()
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
        res["device_used_gb_extra_for_separate_copy"] = device_used_gb() - before
        del plain
        torch.cuda.empty_cache()
        log = (run_dir / "logs" / "vllm.log").read_text(errors="replace")
        res["vllm_log_cuda_graph_lines"] = [ln for ln in log.splitlines() if "CUDA graph" in ln or "cudagraph" in ln.lower()][-5:]
        res["enforce_eager_in_cmd"] = "--enforce-eager" in log
    except Exception:  # report what happened, with the server log, rather than dying silently
        import traceback

        res["error"] = traceback.format_exc()
        log_path = run_dir / "logs" / "vllm.log"
        if log_path.exists():
            res["vllm_log_tail"] = log_path.read_text(errors="replace")[-6000:]
    finally:
        session.shutdown()
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
        print(json.dumps({k: v for k, v in res.items() if k not in ("vllm_log_tail",)}, indent=2, default=str))


if __name__ == "__main__":
    main()

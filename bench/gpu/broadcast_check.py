"""mode=broadcast on 2 GPUs: trainer on GPU 0, vLLM alone on GPU 1; weights pushed by NCCL after each step.

    python bench/gpu/broadcast_check.py --preset qwen3b --out results/broadcast_qwen3b.json

One process beside one vLLM server (the project's NCCLBroadcastSync, exactly as train.py uses it):
1. the NCCL group forms (trainer rank 0 + every vLLM worker) through vLLM's own weight-transfer engine;
2. trainer vs vLLM log-probs of a fixed sequence agree at the start;
3. each round: an AdamW step moves the trainer (the gap to vLLM grows), then a sync (the gap shrinks back): the
   served log-probs follow the trainer; sync seconds, bytes and buckets per round.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def trainer_logprobs(model, tokens: list[int]) -> torch.Tensor:
    from grpo.trainer.logprobs import token_logprobs

    ids = torch.tensor([tokens], device="cuda")
    with torch.no_grad():
        lp = token_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), ids[:, 1:], torch.ones(1, device="cuda"))
    return lp[0].float().cpu()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny-qwen2")
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=9311)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eager", action="store_true", help="--enforce-eager on the server (faster start)")
    args = p.parse_args()

    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from grpo.models.loading import load_model
    from grpo.models.tiny import build_model_dir
    from grpo.schema import ServerConfig
    from grpo.serving.session import ServerSession
    from grpo.sync.base import SyncContext
    from grpo.sync.nccl_broadcast import NCCLBroadcastSync

    torch.cuda.set_device(0)
    tiny = args.preset.startswith("tiny")
    t0 = time.perf_counter()
    model_dir = build_model_dir(args.preset, seed=0, dtype="float32" if tiny else "bfloat16")
    res: dict = {"preset": args.preset, "build_seconds": time.perf_counter() - t0, "bucket_mb": args.bucket_mb}
    server_cfg = OmegaConf.structured(ServerConfig(
        port=args.port, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=512,
        dtype="float32" if tiny else "bfloat16", enforce_eager=True if args.eager else None, device=1,
        startup_timeout_s=400,
    ))
    run_dir = Path(tempfile.mkdtemp(prefix="broadcast_check_"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    sync = NCCLBroadcastSync(bucket_mb=args.bucket_mb)
    session = ServerSession(sync, SyncContext(run_dir=run_dir, model_dir=Path(model_dir), server_cfg=server_cfg,
                                              tokenizer=tok))
    try:
        t0 = time.perf_counter()
        session.launch()
        res["launch_seconds"] = time.perf_counter() - t0  # server start + NCCL group
        res["vllm_workers"] = sync.world_size - 1
        model = load_model(str(model_dir), torch.float32 if tiny else torch.bfloat16, torch.device("cuda", 0), False)
        g = torch.Generator().manual_seed(0)
        vocab = model.get_input_embeddings().num_embeddings
        seq = torch.randint(0, min(vocab, 250) if tiny else 1000, (48,), generator=g).tolist()

        def gap() -> float:
            served = torch.tensor(sync.server.client.prompt_logprobs(seq))
            return float((trainer_logprobs(model, seq) - served).abs().mean())

        res["logprob_diff_start"] = gap()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        rounds = []
        for r in range(args.rounds):
            from grpo.trainer.logprobs import token_logprobs

            ids = torch.tensor([seq], device="cuda")
            lp = token_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), ids[:, 1:])
            (-lp.mean()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = gap()
            m = sync.sync(model, r + 1)
            after = gap()
            version = sync.server.client.weight_version()
            rounds.append({"round": r + 1, "logprob_diff_before_sync": before, "logprob_diff_after_sync": after,
                           "served_version": version, **m})
            print(json.dumps(rounds[-1]), flush=True)
        res["rounds"] = rounds
        res["sync_seconds_mean"] = sum(x["sync/seconds"] for x in rounds) / len(rounds)
        res["sync_seconds_after_first"] = (sum(x["sync/seconds"] for x in rounds[1:]) / max(1, len(rounds) - 1))
        res["follows"] = all(x["logprob_diff_after_sync"] < x["logprob_diff_before_sync"] for x in rounds)
        res["gpu_memory_gb_trainer_peak"] = torch.cuda.max_memory_allocated(0) / 1024**3
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"
        if sync.server.process is not None:
            res["vllm_log_tail"] = sync.server.process.log_tail(60)
        raise
    finally:
        session.shutdown()
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k not in ("rounds", "vllm_log_tail")}))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Issue 10 on the 2-GPU machine (nvidia-h200-x2), after the vLLM 0.26 kit is installed (bench/gpu/README.md):
#   bash bench/gpu/multi_gpu.sh            # all three parts, < 9 minutes
#   bash bench/gpu/multi_gpu.sh fsdp|train|qwen3b|none|async   (none, async: not part of "all")
# (c) fsdp:   FSDP2 on 2 GPUs vs 1 GPU, same batch: loss, grad norm and updated weights agree (fsdp_compare.json)
# (a) train:  train.py mode=broadcast, tiny model, trainer on GPU 0, vLLM on GPU 1 (metrics_broadcast_tiny.jsonl:
#             grpo/logprob_diff stays small after every sync; sync/seconds, sync/bytes, sync/buckets per step)
# (b) qwen3b: qwen3b-sized random weights, vLLM on GPU 1: sync seconds per round and served log-probs following
#             the trainer (broadcast_qwen3b.json)
# (d) none:   torchrun train.py mode=none on 2 GPUs (FSDP2), checkpoints every step, then a resume
# (e) async:  train.py mode=broadcast at qwen3b size, vLLM on GPU 1, train.max_staleness=0,1 (issue 18; not run yet)
# Small result files land at the top level of $OUT (or bench/results/gpu when OUT is unset).
set -uo pipefail
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 GRPO_CACHE=/tmp/grpo-cache WANDB_MODE=disabled
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
work=$(mktemp -d /tmp/multi_gpu.XXXX)
what=${1:-all}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpu_multi.txt"
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" 2>/dev/null | tee -a "$out/gpu_multi.txt"
t_start=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t_start ))s"; }

if [[ $what == all || $what == fsdp ]]; then
  stamp "fsdp (c)"
  timeout 90 torchrun --nproc-per-node 1 --master-port 29611 bench/gpu/fsdp_check.py --out "$work/fsdp_world1.json" 2>&1 | tail -5
  timeout 90 torchrun --nproc-per-node 2 --master-port 29612 bench/gpu/fsdp_check.py --out "$work/fsdp_world2.json" 2>&1 | tail -5
  python3 bench/gpu/fsdp_check.py --compare "$work/fsdp_world1.json" "$work/fsdp_world2.json"
  cp "$work"/fsdp_world1.json "$work"/fsdp_world2.json "$work"/fsdp_compare.json "$out/" 2>/dev/null
fi

if [[ $what == all || $what == train ]]; then
  stamp "train.py mode=broadcast tiny (a)"
  # Eager vLLM: start-up in well under a minute instead of ~95 s of graph capture (the sync path is the same).
  timeout 160 python3 train.py '~experiment' mode=broadcast server=gpu server.device=1 server.enforce_eager=true \
    server.gpu_memory_utilization=0.3 server.max_model_len=512 server.dtype=float32 train.device=cuda model.dtype=float32 \
    train.steps=8 train.micro_batch_size=32 train.grad_accum=2 train.checkpoint_every=1000 mode.bucket_mb=1 \
    logging.progress_bar=false logging.plot=false hydra.run.dir="$work/train_tiny" 2>&1 | grep -vE "INFO|DEBUG" | tail -25
  cp "$work/train_tiny/metrics.jsonl" "$out/metrics_broadcast_tiny.jsonl" 2>/dev/null
  cp "$work/train_tiny/summary.json" "$out/summary_broadcast_tiny.json" 2>/dev/null
  tail -c 6000 "$work/train_tiny/logs/vllm.log" > "$out/vllm_broadcast_tiny.log" 2>/dev/null
  python3 - "$out/metrics_broadcast_tiny.jsonl" <<'PY' | tee "$out/broadcast_tiny_summary.json"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
keys = ["step", "reward/mean", "loss", "grpo/logprob_diff", "sync/seconds", "sync/paused_seconds", "sync/bytes", "sync/buckets", "sync/version"]
print(json.dumps({"steps": [{k: r.get(k) for k in keys} for r in rows]}, indent=0))
PY
fi

if [[ $what == all || $what == qwen3b ]]; then
  stamp "qwen3b broadcast sync (b)"
  timeout 190 python3 bench/gpu/broadcast_check.py --preset qwen3b --eager --rounds 4 --lr 1e-5 --bucket-mb 512 \
    --gpu-memory-utilization 0.5 --out "$work/broadcast_qwen3b.json" 2>&1 | grep -vE "INFO|DEBUG" | tail -20
  cp "$work/broadcast_qwen3b.json" "$out/" 2>/dev/null
fi
if [[ $what == none ]]; then
  stamp "torchrun train.py mode=none, FSDP2 on 2 GPUs, vLLM beside rank 0 (d)"
  # 2 steps with a checkpoint each, then a resume to step 3 in the same run dir (what tests/test_distributed.py
  # checks on CPU/gloo), here with NCCL.
  run_none() {
    timeout 230 torchrun --nproc-per-node 2 --master-port 29631 train.py '~experiment' mode=none server=gpu server.enforce_eager=true \
      server.gpu_memory_utilization=0.3 server.max_model_len=512 server.dtype=float32 train.device=cuda model.dtype=float32 \
      train.micro_batch_size=32 train.grad_accum=2 train.checkpoint_every=1 logging.progress_bar=false logging.plot=false \
      hydra.run.dir="$work/fsdp_none" "$@" 2>&1 | grep -vE "INFO|DEBUG|Loading weights|Writing model" | tail -12
  }
  run_none train.steps=2
  run_none train.steps=3 train.resume="$work/fsdp_none"
  cp "$work/fsdp_none/metrics.jsonl" "$out/metrics_fsdp_none.jsonl" 2>/dev/null
  ls "$work/fsdp_none/checkpoints" "$work/fsdp_none/checkpoints/step_000003" > "$out/fsdp_none_checkpoints.txt" 2>&1
  tail -c 4000 "$work/fsdp_none/logs/vllm.log" > "$out/vllm_fsdp_none.log" 2>/dev/null
fi
if [[ $what == async ]]; then
  stamp "train.py mode=broadcast qwen3b, vLLM on GPU 1, train.max_staleness 0 vs 1 (issue 18)"
  # Trainer on GPU 0, vLLM on GPU 1 with CUDA graphs: generation of the next batch overlaps training, the
  # broadcast pauses generation only for the transfer. Target (issue 18): k=1 >= 1.8x k=0's steps/s.
  timeout 560 python3 train.py -m '~experiment' mode=broadcast server=gpu server.device=1 \
    server.gpu_memory_utilization=0.8 server.max_model_len=1024 model=qwen3b model.offline=qwen3b \
    model.gradient_checkpointing=true data=local_digits data.max_new_tokens=128 data.prompts_per_step=8 \
    data.group_size=8 train.micro_batch_size=16 train.grad_accum=4 optimizer.lr=1e-6 eval=off train.steps=10 \
    train.checkpoint_every=1000 train.max_staleness=0,1 logging.progress_bar=false logging.plot=false \
    hydra.sweep.dir="$work/async" 2>&1 | grep -vE "INFO|DEBUG" | tail -25
  for k in 0 1; do cp "$work/async/$k/metrics.jsonl" "$out/metrics_broadcast_async_k$k.jsonl" 2>/dev/null; done
fi
stamp "done"

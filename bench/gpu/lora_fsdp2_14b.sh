#!/usr/bin/env bash
# LoRA under FSDP2 at 14 B on two GPUs (nvidia-h100-x2 or h200-x2, after the vLLM kit is installed: bench/gpu/README.md).
# Two 14 B start-ups (the random-weight directory built first, vLLM's start-up ~3.5 min at 14 B) outlast one device
# call, so start it detached and read its files in a later call:
#   setsid nohup bash bench/gpu/lora_fsdp2_14b.sh > /tmp/lora_fsdp2_14b.log 2>&1 < /dev/null &
#   tail -5 /tmp/lora_fsdp2_14b.log; cat bench/results/gpu/lora_fsdp2_14b_summary.json   # (or $OUT's) once done
# experiment=qwen14b_lora_fsdp2 with random weights of the real shape (model.offline=qwen14b), torchrun over both GPUs,
# vLLM beside rank 0: 4 steps with a checkpoint every 2, then a resume in the same run dir to step 6. Shows that it
# trains, syncs (sync/gathered_bytes == sync/adapter_bytes every step: the adapter alone is gathered) and resumes
# (the resumed rows start at step 5, the served weight version goes on). Writes to $OUT (or bench/results/gpu):
# metrics_lora_fsdp2_14b.jsonl, lora_fsdp2_14b_checkpoints.txt, lora_fsdp2_14b_summary.json, vllm_lora_fsdp2_14b.log.
set -uo pipefail
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 GRPO_CACHE=/tmp/grpo-cache WANDB_MODE=disabled
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
run=/tmp/runs/lora_fsdp2_14b
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpu_lora_fsdp2_14b.txt"
train() {
  timeout 1200 torchrun --nproc-per-node 2 --master-port 29641 train.py experiment=qwen14b_lora_fsdp2 model.offline=qwen14b \
    eval=off train.checkpoint_every=2 logging.progress_bar=false hydra.run.dir="$run" "$@" 2>&1 \
    | grep -vE "INFO|DEBUG|Loading weights|Writing model" | tail -15
}
t0=$(date +%s)
train train.steps=4
t1=$(date +%s)
train train.steps=6 train.resume="$run"
t2=$(date +%s)
cp "$run/metrics.jsonl" "$out/metrics_lora_fsdp2_14b.jsonl" 2>/dev/null
ls -la "$run/checkpoints" "$run"/checkpoints/step_* > "$out/lora_fsdp2_14b_checkpoints.txt" 2>&1
tail -c 6000 "$run/logs/vllm.log" > "$out/vllm_lora_fsdp2_14b.log" 2>/dev/null
python3 - "$run/metrics.jsonl" "$((t1 - t0))" "$((t2 - t1))" <<'PY' | tee "$out/lora_fsdp2_14b_summary.json"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
keys = ["step", "loss", "time/step_seconds", "generation/seconds", "sync/seconds", "sync/gathered_bytes",
        "sync/adapter_bytes", "sync/served_version", "memory/peak_gb"]
synced = [r for r in rows if "sync/adapter_bytes" in r]
print(json.dumps({"first_run_s": int(sys.argv[2]), "resumed_run_s": int(sys.argv[3]),
                  "steps": [r["step"] for r in rows],
                  "adapter_alone_every_sync": bool(synced) and all(r["sync/gathered_bytes"] == r["sync/adapter_bytes"] for r in synced),
                  "rows": [{k: r.get(k) for k in keys} for r in rows]}, indent=1))
PY

#!/usr/bin/env bash
# The long-completion benchmark on a lent 2-GPU machine (nvidia-h100-x2 or h200-x2), after the vLLM kit is installed
# (bench/gpu/README.md). The plans run detached (bench/gpu/run_plan.py --queue: each job as soon as its GPUs are
# free), so a call only starts them and another collects:
#   bash bench/gpu/long_completions.sh start bench/gpu/plans/long_completions_2k_2gpu.txt
#   bash bench/gpu/long_completions.sh collect [SECONDS]   # waits up to SECONDS for the plan, then copies and tabulates
# Arms (experiment=qwen3b_long_completions, completions forced to 2 k or 8 k tokens): one GPU synchronous,
# asynchronous (train.max_staleness=1) and in-flight updates (mode.in_flight_updates=true); two GPUs synchronous and
# asynchronous (mode=broadcast, vLLM alone on GPU 1); TRL's colocate step (bench/gpu/trl_step.py) on the same
# workload. Writes $OUT/long_completions/long_completions.{md,json} (bench/gpu/long_completions.py: step parts, MFU,
# memory peak, generation's share; medians of the steps after the first) and $OUT/plan_out.tgz (every job's files).
set -uo pipefail
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 GRPO_CACHE=/tmp/grpo-cache WANDB_MODE=disabled
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
case "${1:-}" in
  start)
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpu_long_completions.txt"
    bash bench/gpu/real_model.sh plan "$2" --queue ;;
  collect)
    bash bench/gpu/real_model.sh collect "${2:-0}"
    python3 bench/gpu/long_completions.py /tmp/plan_out --out "$out/long_completions" ;;
  *) echo "usage: $0 start PLAN | collect [SECONDS]"; exit 2 ;;
esac

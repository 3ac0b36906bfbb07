#!/usr/bin/env bash
# One run of the real-model experiment, timed from process start by bench/gpu/startup_probe.py (after the kit and
# `bash bench/gpu/real_model.sh setup`): evaluation every 25 steps against evaluation only at the end.
#   bash bench/gpu/eval_overhead_run.sh every25 eval.every=25
#   bash bench/gpu/eval_overhead_run.sh atend eval.every=0
# Writes $OUT/runs.jsonl (timings and summary.json, one line a run), metrics_TAG.jsonl.gz and vllm_TAG.log.gz.
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GRPO_CACHE=/tmp/grpo-cache WANDB_MODE=disabled
tag=$1; shift
out=${OUT:-bench/results/gpu}
python3 bench/gpu/startup_probe.py --tag "$tag" --out "$out/runs.jsonl" --run-dir "/tmp/runs/$tag" -- \
  experiment=smollm2_chat_arith_shared train.seed=${SEED:-9} "$@" 2>&1 | cut -c1-3000
gzip -c "/tmp/runs/$tag/metrics.jsonl" > "$out/metrics_$tag.jsonl.gz"
gzip -c "/tmp/runs/$tag/logs/vllm.log" > "$out/vllm_$tag.log.gz"
tail -c 2500 "/tmp/runs/$tag/train.log"

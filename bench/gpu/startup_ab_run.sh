#!/usr/bin/env bash
# One short run of the real-model experiment timed from process start (bench/gpu/eval_overhead_run.sh: runs.jsonl,
# the run's metrics and vLLM log), with the command's preloaded vLLM import (grpo.inference.preload) on or off:
#   SEED=17 bash bench/gpu/startup_ab_run.sh on|off TAG [overrides]
preload=$1; tag=$2; shift 2
case $preload in
  on) flag=1 ;;
  off) flag=0 ;;
  *) echo "usage: startup_ab_run.sh on|off TAG [overrides]" >&2; exit 2 ;;
esac
GRPO_PRELOAD_SERVER=$flag bash bench/gpu/eval_overhead_run.sh "$tag" train.steps=30 eval.every=0 "$@"

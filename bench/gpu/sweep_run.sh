#!/usr/bin/env bash
# One multirun of the real-model experiment on the GPUs it is given (after the kit and `bash bench/gpu/real_model.sh
# setup`), timed from its process start; each job's summary.json and the sweep's wall clock into $OUT:
#   bash bench/gpu/sweep_run.sh TAG optimizer.lr=2e-5,3e-5,4e-5 loss.clip_eps=0.2,0.28 train.steps=100
#   bash bench/gpu/sweep_run.sh TAG_parallel hydra/launcher=grpo_parallel hydra.launcher.jobs_at_once=4 ...
#   bash bench/gpu/sweep_run.sh TAG_lora experiment=smollm2_chat_arith_lora lora.r=8,16 ...   (another experiment)
# Prints the sweep's output (bench/gpu/run_plan.py's stall guard watches it); writes $OUT/sweep_TAG.json (the sweep's
# wall clock, each job's summary) and $OUT/sweep_TAG.log.gz.
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GRPO_CACHE=/tmp/grpo-cache WANDB_MODE=disabled
tag=$1; shift
out=${OUT:-bench/results/gpu}
dir=/tmp/runs/sweep_$tag
# The real-model experiment unless the overrides name another (e.g. experiment=smollm2_chat_arith_lora).
experiment=experiment=smollm2_chat_arith_shared
for a in "$@"; do [[ $a == experiment=* ]] && experiment=$a; done
args=()
for a in "$@"; do [[ $a == experiment=* ]] || args+=("$a"); done
t0=$(date +%s.%N)
python3 train.py -m "$experiment" logging.progress_bar=false logging.plot=false \
  "hydra.sweep.dir=$dir" "${args[@]}" 2>&1 | tee "/tmp/sweep_$tag.log" | grep --line-buffered -v "^\s*$"
rc=${PIPESTATUS[0]}
t1=$(date +%s.%N)
gzip -c "/tmp/sweep_$tag.log" > "$out/sweep_$tag.log.gz"
python3 - "$dir" "$t0" "$t1" "$rc" "$tag" "$out" "$*" <<'PY'
import json, sys
from pathlib import Path
d, t0, t1, rc, tag, out, args = sys.argv[1:]
jobs = []
for s in sorted(Path(d).glob("*/summary.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0):
    summary = json.loads(s.read_text())
    jobs.append({"job": s.parent.name, **summary})
row = {"tag": tag, "overrides": args, "rc": int(rc), "sweep_wall_s": round(float(t1) - float(t0), 1), "jobs": jobs}
Path(out, f"sweep_{tag}.json").write_text(json.dumps(row, indent=1))
print(json.dumps({k: v for k, v in row.items() if k != "jobs"}), len(jobs), "jobs")
PY

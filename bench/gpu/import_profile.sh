#!/usr/bin/env bash
# Where the seconds before vLLM's API server prints its first line go on a lent host: `import
# vllm.entrypoints.openai.api_server` (what `python -m grpo.inference.server` runs first) timed twice in a row (the
# second with the file cache warm, as a run's warm start-up), each with `python -X importtime`; the modules that cost
# most (cumulative and self) into $OUT/import_profile.txt. With `shm`, a third round imports from a copy of the
# interpreter's site-packages in /dev/shm (memory): on a host whose file system answers each lookup slowly (the lent
# GPU hosts run under gVisor) the import's 6,000-odd modules cost their lookups more than their code.
#   bash bench/gpu/import_profile.sh [shm]    (after the kit; a plan's `sh` job)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
out=${OUT:-bench/results/gpu}
report=$out/import_profile.txt
: > "$report"
rounds="first second"
if [ "${1:-}" = shm ]; then
  site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  t0=$(date +%s.%N); cp -a "$site" /dev/shm/site; t1=$(date +%s.%N)
  echo "copied $site ($(du -sh /dev/shm/site | cut -f1)) to /dev/shm/site in $(python3 -c "print(round($t1 - $t0, 1))") s" >> "$report"
  rounds="first second shm"
fi
for round in $rounds; do
  t0=$(date +%s.%N)
  if [ "$round" = shm ]; then  # /dev/shm/site first on the path: every module found there
    PYTHONPATH=/dev/shm/site:$PYTHONPATH python3 -X importtime -c "import vllm.entrypoints.openai.api_server" 2> "/tmp/importtime_$round.txt"
  else
    python3 -X importtime -c "import vllm.entrypoints.openai.api_server" 2> "/tmp/importtime_$round.txt"
  fi
  t1=$(date +%s.%N)
  python3 - "$round" "$t0" "$t1" "/tmp/importtime_$round.txt" >> "$report" <<'PY'
import sys
round_, t0, t1, path = sys.argv[1:]
rows = []
for line in open(path):
    if not line.startswith("import time:") or "self [us]" in line:
        continue
    self_us, cum_us, name = line[len("import time:"):].rstrip("\n").split("|")
    depth = (len(name) - len(name.lstrip()) - 1) // 2  # `| name` at the top of a chain, two spaces more per level
    rows.append((int(self_us), int(cum_us), depth, name.strip()))
print(f"== {round_} import of vllm.entrypoints.openai.api_server: {float(t1) - float(t0):.1f} s wall, "
      f"{sum(r[0] for r in rows) / 1e6:.1f} s summed self time over {len(rows)} modules")
print("-- self seconds summed per top-level package")
top = {}
for s, c, d, n in rows:
    top[n.split(".")[0]] = top.get(n.split(".")[0], 0) + s
for n, c in sorted(top.items(), key=lambda kv: -kv[1])[:15]:
    print(f"  {c / 1e6:6.2f}  {n}")
print("-- modules by self seconds")
for s, c, d, n in sorted(rows, key=lambda r: -r[0])[:25]:
    print(f"  {s / 1e6:6.2f}  {n}")
PY
done
for mod in torch transformers vllm; do
  /usr/bin/env python3 -c "import time; t=time.time(); import $mod; print('import $mod alone (warm): %.1f s' % (time.time() - t))" >> "$report" 2>/dev/null
done
cat "$report"

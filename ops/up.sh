#!/usr/bin/env bash
# Install (if needed) and start the whole system as local processes: nats-server, redis-server and
# every ferry service. Arguments go to `ferry up` (see `ferry up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/install.sh
exec .venv/bin/ferry up "$@"

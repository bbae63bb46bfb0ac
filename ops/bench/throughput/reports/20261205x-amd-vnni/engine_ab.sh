#!/bin/bash
# The SmolLM2 burst in the engine (steps.py smollm2 steps), the kernel before this round (a `git archive` of
# 87d6d4b in $BASE, its own extension build) and after (this worktree), alternating, ROUNDS rounds, in one call:
#   /work/tools/cpu-bench bash ops/bench/throughput/reports/20261205x-amd-vnni/engine_ab.sh > .../engine_ab.txt
BASE=${BASE:-/tmp/vnni_base}
NEW=$(cd "$(dirname "$0")/../../../../.." && pwd)
for round in $(seq "${ROUNDS:-2}"); do
  for side in old new; do
    dir=$([ $side = old ] && echo "$BASE" || echo "$NEW")
    echo "== round $round $side ($dir)"
    (cd "$dir" && source /work/tools/env.sh && python ops/bench/throughput/steps.py smollm2 steps 2>&1 | grep -v Wc++20)
  done
done

#!/bin/bash
# SmolLM2 engine burst (steps.py smollm2 steps, in-process, run.py's 48-request burst), whole-prompt attention
# through torch's SDPA path (FERRY_PREFILL_ATTN_CPP=0) vs the C++ prefill kernel (=1), interleaved:
#   /work/tools/cpu-bench bash ops/bench/throughput/reports/20261205x-amd-prefill-attn/engine_ab.sh > $R/engine_ab.txt
for round in 1 2 3 4; do
  for setting in 0 1; do
    echo "== FERRY_PREFILL_ATTN_CPP=$setting $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    FERRY_PREFILL_ATTN_CPP=$setting timeout 34 python ops/bench/throughput/steps.py smollm2 steps
  done
done

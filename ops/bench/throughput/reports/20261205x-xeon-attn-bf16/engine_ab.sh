#!/bin/bash
# SmolLM2 engine burst (steps.py smollm2 steps, in-process, run.py's 48-request burst), widening vs VDPBF16PS
# decode attention, interleaved:
#   /work/tools/cpu-bench bash ops/bench/throughput/reports/20261205x-xeon-attn-bf16/engine_ab.sh > $R/engine_ab.txt
for round in 1 2 3; do
  for setting in 0 1; do
    echo "== FERRY_DECODE_BF16_DOT=$setting $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    FERRY_DECODE_BF16_DOT=$setting timeout 80 python ops/bench/throughput/steps.py smollm2 steps
  done
done

#!/bin/bash
# Engine burst A/B, interleaved: the AMX int8 tiles off (FERRY_QUANT_AMX_INT8=0) vs the default (from 8 rows).
#   /work/tools/cpu-bench bash ops/bench/quant/20261205c-xeon-amx-int8/engine_ab.sh > .../engine_ab.txt
for round in 1 2 3; do
  for setting in 0 8; do
    echo "== FERRY_QUANT_AMX_INT8=$setting $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    FERRY_QUANT_AMX_INT8=$setting timeout 95 python ops/bench/throughput/steps.py smollm2 steps
  done
done

#!/bin/bash
# Engine burst A/B, interleaved: the bf16 copies packed for oneDNN from 24 rows (before), for our AMX bf16 GEMM
# (csrc/bf16_amx.h) from 24 rows, and ours from 16 rows (the new default).
#   /work/tools/cpu-bench bash ops/bench/quant/20261205d-xeon-amx-bf16-kernel/engine_ab.sh > .../engine_ab.txt
cd "$(dirname "$0")/../../../.."
for round in 1 2; do
  for v in "0 24" "1 24" "1 16"; do
    set -- $v
    echo "== FERRY_QUANT_BF16_AMX=$1 FERRY_QUANT_BF16_COPY_FROM_ROWS=$2 $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    FERRY_QUANT_BF16_AMX=$1 FERRY_QUANT_BF16_COPY_FROM_ROWS=$2 timeout 60 python ops/bench/throughput/steps.py smollm2 steps 2>&1 | grep -v USDT
  done
done

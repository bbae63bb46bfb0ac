#!/bin/bash
# Engine burst A/B, interleaved four times: before (copies packed for oneDNN, from 24 rows) vs after (our AMX bf16
# GEMM from 16 rows, the new default).
#   /work/tools/cpu-bench bash ops/bench/quant/20261205d-xeon-amx-bf16-kernel/engine_ab2.sh > .../engine_ab2.txt
cd "$(dirname "$0")/../../../.."
for round in 1 2 3 4; do
  for v in "0 24" "1 16"; do
    set -- $v
    echo "== FERRY_QUANT_BF16_AMX=$1 FERRY_QUANT_BF16_COPY_FROM_ROWS=$2 $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    FERRY_QUANT_BF16_AMX=$1 FERRY_QUANT_BF16_COPY_FROM_ROWS=$2 timeout 60 python ops/bench/throughput/steps.py smollm2 steps 2>&1 | grep -v USDT
  done
done

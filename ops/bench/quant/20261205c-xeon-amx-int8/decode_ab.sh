#!/bin/bash
# Decode step (int8 / int4 weights vs fp32, interleaved per step by quant_decode) with the AMX int8 tiles off and on,
# alternating twice, one process per side:
#   /work/tools/cpu-bench bash ops/bench/quant/20261205c-xeon-amx-int8/decode_ab.sh > .../decode_ab.txt
D=ops/bench/quant/20261205c-xeon-amx-int8
for run in 1 2; do
  for setting in 0 8; do
    echo "== FERRY_QUANT_AMX_INT8=$setting run $run $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    FERRY_QUANT_AMX_INT8=$setting timeout 70 python ops/bench/quant/decode_step.py --model smollm2 --batches 1,8,16,23 \
      --steps 10 --out $D/decode-amx$setting-run$run > /dev/null
  done
done

#!/bin/bash
# After wt/vnni and wt/bf16dot merged (main c514629): the crossover of the int4 kernel and bf16_dot_linear again, then
# the engine burst with FERRY_QUANT_BF16_COPY_FROM_ROWS 24 (bf16dot's default) vs 32, alternating, 3 rounds.
#   /work/tools/cpu-bench bash ops/bench/throughput/reports/20261205x-amd-copy-rows-after-vnni/ab.sh > $R/ab.txt
R=ops/bench/throughput/reports/20261205x-amd-copy-rows-after-vnni
mkdir -p /tmp/lead/xover2
python ops/bench/quant/amx_rows.py --rows 16,20,24,28,32,36,40,48 --columns int4_kernel_ms,bf16_dot_ms --out /tmp/lead/xover2
cp /tmp/lead/xover2/amx_rows.json $R/sweep2.json
for i in 1 2 3; do
  for rows in 24 32; do
    echo "== rows $rows"
    FERRY_QUANT_BF16_COPY_FROM_ROWS=$rows python ops/bench/throughput/steps.py smollm2 steps 2>&1 | grep -A3 wall
  done
done

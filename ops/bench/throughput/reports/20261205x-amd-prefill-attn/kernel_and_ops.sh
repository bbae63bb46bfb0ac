#!/bin/bash
# The microbench (C++ kernel vs repeat_interleave + SDPA, interleaved per call) and the burst's prefill-step ops
# with the kernel off and on:
#   /work/tools/cpu-bench bash ops/bench/throughput/reports/20261205x-amd-prefill-attn/kernel_and_ops.sh
R=ops/bench/throughput/reports/20261205x-amd-prefill-attn
echo "== microbench $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
python ops/bench/throughput/prefill_attn.py --lengths 17,50,150,400,600 --json $R/prefill_attn.json > $R/prefill_attn.txt 2>&1
cat $R/prefill_attn.txt
for setting in 0 1; do
  echo "== prefill-ops FERRY_PREFILL_ATTN_CPP=$setting $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  FERRY_PREFILL_ATTN_CPP=$setting timeout 80 python ops/bench/throughput/steps.py smollm2 prefill-ops > $R/prefill_ops_$setting.txt 2>&1
  head -4 $R/prefill_ops_$setting.txt
done

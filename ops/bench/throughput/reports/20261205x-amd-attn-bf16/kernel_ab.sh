#!/bin/bash
# Decode attention, widening (bf16_dot 0) vs VDPBF16PS (bf16_dot 1) on a bf16 cache, interleaved in one process each:
#   g++ -O2 -march=native ops/bench/throughput/bf16_dot_rate.cpp -o /tmp/bf16_dot_rate
#   /work/tools/cpu-bench bash ops/bench/throughput/reports/20261205x-amd-attn-bf16/kernel_ab.sh > $R/kernel_ab.txt
R=ops/bench/throughput/reports/20261205x-amd-attn-bf16
/tmp/bf16_dot_rate
python ops/bench/throughput/decode_attention.py --shapes 8x300,8x1000,25x450,48x300,48x1000 --dtypes bfloat16 \
    --bf16-dot 0,1 --json $R/decode_attention.json
python ops/bench/throughput/decode_step_profile.py --batches 8,48 --kv-dtypes bfloat16 --bf16-dot 0,1 \
    --json $R/decode_step_300.json
python ops/bench/throughput/decode_step_profile.py --batches 8,48 --kv-dtypes bfloat16 --bf16-dot 0,1 \
    --prompt-tokens 1000 --json $R/decode_step_1000.json

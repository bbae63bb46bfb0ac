#!/bin/bash
# What removing the bf16 widening could buy at most: the base kernel (d3abd4c) against the same kernel whose bf16
# loadv reads the same 32 bytes as 8 floats with no widening (wrong values, same bytes and FMAs; a throwaway copy
# in /tmp/attn_nowiden). Processes alternated, base first. Setup (from the repo root):
#   for t in base nowiden; do mkdir -p /tmp/attn_$t && git archive d3abd4c libs ops | tar -x -C /tmp/attn_$t; done
#   in /tmp/attn_nowiden/libs/ferry/kernels/csrc/cpu_math.h, make the first line of loadv(const bf16* p)'s
#   FERRY_CPU_LANES == 16 branch: return reinterpret_cast<vecf>(_mm512_castps256_ps512(_mm256_loadu_ps(
#       reinterpret_cast<const float*>(p))));
#   /work/tools/cpu-bench bash ops/bench/throughput/reports/20261205x-xeon-attn-bf16/widen_bound.sh > $R/widen_bound.txt
for round in 1 2; do
  for tree in base nowiden; do
    echo "== $tree"
    (cd /tmp/attn_$tree && PYTHONPATH=/tmp/attn_$tree/libs:/tmp/attn_$tree TORCH_EXTENSIONS_DIR=/tmp/attn_$tree/.torch-ext \
      python ops/bench/throughput/decode_attention.py --shapes 8x300,8x1000,48x300,48x1000 --dtypes bfloat16)
  done
done

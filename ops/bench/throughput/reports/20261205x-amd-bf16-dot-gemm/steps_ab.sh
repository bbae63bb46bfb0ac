# old: the copies packed for oneDNN from 64 rows (the previous AVX512_BF16 default); new: ours from 20 (the new default);
# ours64: ours at the old row count. Two rounds, alternating, one cpu-bench call.
for i in 1 2; do
 for c in old new ours64; do
  case $c in
   old) env="FERRY_QUANT_BF16_DOT_GEMM=0 FERRY_QUANT_BF16_COPY_FROM_ROWS=64";;
   new) env="FERRY_QUANT_BF16_DOT_GEMM=1 FERRY_QUANT_BF16_COPY_FROM_ROWS=20";;
   ours64) env="FERRY_QUANT_BF16_DOT_GEMM=1 FERRY_QUANT_BF16_COPY_FROM_ROWS=64";;
  esac
  echo "== $c ($env)"; env $env python ops/bench/throughput/steps.py smollm2 steps 2>&1 | tail -5
 done
done

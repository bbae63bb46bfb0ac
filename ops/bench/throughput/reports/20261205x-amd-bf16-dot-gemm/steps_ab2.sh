# old vs new only, three rounds, alternating, one cpu-bench call (the defaults: new needs no setting).
for i in 1 2 3; do
 for c in old new; do
  case $c in
   old) env="FERRY_QUANT_BF16_DOT_GEMM=0 FERRY_QUANT_BF16_COPY_FROM_ROWS=64";;
   new) env="FERRY_QUANT_BF16_DOT_GEMM=1";;
  esac
  echo "== $c ($env)"; env $env python ops/bench/throughput/steps.py smollm2 steps 2>&1 | tail -5
 done
done

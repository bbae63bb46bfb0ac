for i in 1 2; do
 for c in 0 16 64; do echo "copy=$c"; FERRY_QUANT_BF16_COPY_FROM_ROWS=$c python ops/bench/throughput/steps.py smollm2 steps 2>&1 | tail -4; done
done

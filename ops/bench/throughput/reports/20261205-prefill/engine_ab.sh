#!/bin/bash
# engine A/B, interleaved: FERRY_QUANT_BF16_ACTIVATIONS=0 (old: fp32 between the bf16 copies) vs 1 (new default),
# then the new default with the burst's prompts shortest first (STEPS_ORDER=shortest, in-process only)
cd "$(dirname "$0")/../../../../.."
for v in "0" "1" "0" "1" "1 shortest"; do
  set -- $v
  echo "== FERRY_QUANT_BF16_ACTIVATIONS=$1 STEPS_ORDER=${2:-fcfs}"
  FERRY_QUANT_BF16_ACTIVATIONS=$1 STEPS_ORDER=${2:-fcfs} python ops/bench/throughput/steps.py smollm2 steps 2>&1 | grep -v USDT
done

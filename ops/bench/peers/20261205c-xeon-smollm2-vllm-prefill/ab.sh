#!/bin/bash
# one cpu-bench call, same burst (48 requests): `ferry up` as before this round (FERRY_QUANT_BF16_ACTIVATIONS=0,
# FERRY_PREFILL_ORDER=fcfs), then with both
# (bf16 activations, FERRY_PREFILL_ORDER=shortest) and vLLM
cd "$(dirname "$0")/../../../.."
FERRY_QUANT_BF16_ACTIVATIONS=0 FERRY_PREFILL_ORDER=fcfs python ops/bench/throughput/run.py --model smollm2 --systems ferry-up  \
    --phase-time-limit 100 --ready-timeout 100 --out ops/bench/peers/20261205c-xeon-smollm2-vllm-prefill/before

FERRY_PREFILL_ORDER=shortest python ops/bench/throughput/run.py --model smollm2 --systems ferry-up,vllm  \
    --vllm-python /work/peers/vllm-venv/bin/python --phase-time-limit 150 --ready-timeout 150 --out ops/bench/peers/20261205c-xeon-smollm2-vllm-prefill

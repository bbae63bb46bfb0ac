#!/bin/bash
# one cpu-bench call, same burst (24 requests): `ferry up` as before this round (FERRY_QUANT_BF16_ACTIVATIONS=0,
# FERRY_PREFILL_ORDER=fcfs), with bf16 activations only (the committed defaults), then with both
# (bf16 activations, FERRY_PREFILL_ORDER=shortest) and vLLM
cd "$(dirname "$0")/../../../.."
FERRY_QUANT_BF16_ACTIVATIONS=0 FERRY_PREFILL_ORDER=fcfs python ops/bench/throughput/run.py --model smollm2 --systems ferry-up --num-requests 24 --seed 2 \
    --phase-time-limit 100 --ready-timeout 100 --out ops/bench/peers/20261205c-xeon-smollm2-vllm-prefill-24-seed2/before
FERRY_PREFILL_ORDER=fcfs python ops/bench/throughput/run.py --model smollm2 --systems ferry-up --num-requests 24 --seed 2 --phase-time-limit 100 --ready-timeout 100 --out ops/bench/peers/20261205c-xeon-smollm2-vllm-prefill-24-seed2/bf16-fcfs
FERRY_PREFILL_ORDER=shortest python ops/bench/throughput/run.py --model smollm2 --systems ferry-up,vllm --num-requests 24 --seed 2 \
    --vllm-python /work/peers/vllm-venv/bin/python --phase-time-limit 150 --ready-timeout 150 --out ops/bench/peers/20261205c-xeon-smollm2-vllm-prefill-24-seed2

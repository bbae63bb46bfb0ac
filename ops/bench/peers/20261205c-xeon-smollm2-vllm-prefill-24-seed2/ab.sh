#!/bin/bash
# one cpu-bench call: `ferry up` with FERRY_QUANT_BF16_ACTIVATIONS=0 (fp32 between the bf16 copies: before this round),
# then `ferry up` (default: bf16 between them) and vLLM, same burst (24 requests)
cd "$(dirname "$0")/../../../.."
FERRY_QUANT_BF16_ACTIVATIONS=0 python ops/bench/throughput/run.py --model smollm2 --systems ferry-up --num-requests 24 --seed 2 \
    --phase-time-limit 150 --ready-timeout 150 --out ops/bench/peers/20261205c-xeon-smollm2-vllm-prefill-24-seed2/act-off
python ops/bench/throughput/run.py --model smollm2 --systems ferry-up,vllm --num-requests 24 --seed 2 \
    --vllm-python /work/peers/vllm-venv/bin/python --phase-time-limit 150 --ready-timeout 150 --out ops/bench/peers/20261205c-xeon-smollm2-vllm-prefill-24-seed2

#!/bin/bash
# one cpu-bench call, 48-request burst (seed 0), `ferry up` with bf16 activations (default): FERRY_PREFILL_ORDER=fcfs
# (the default), shortest, fcfs again, shortest again
cd "$(dirname "$0")/../../../.."
OUT=ops/bench/peers/20261205c-xeon-smollm2-ferryup-order-ab
for run in fcfs-1 shortest-1 fcfs-2 shortest-2; do
  FERRY_PREFILL_ORDER=${run%-*} python ops/bench/throughput/run.py --model smollm2 --systems ferry-up \
      --phase-time-limit 60 --ready-timeout 60 --out $OUT/$run
done

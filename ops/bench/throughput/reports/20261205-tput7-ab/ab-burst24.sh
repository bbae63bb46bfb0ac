#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
R=ops/bench/throughput/reports/20261205-tput7-ab; M=/tmp/tput/bench-llama
python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 1 --num-requests 24 --engine \
  --variant 'w0=FERRY_ADMISSION_WINDOW_MS=0' --variant 'w20=' --json $R/window-burst24.json 2>&1 | tail -5

#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama
OFF='FERRY_PIPELINE_DEPTH=1 FERRY_LOOP_SCHED_BATCH=0 FERRY_SUPPORT_SCHED_BATCH=0 FERRY_STREAM_INTERVAL_MS=20'
echo "== 24 requests, seeds 1 and 2"
timeout 150 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 2 --num-requests 24 --engine --flops \
  --variant "before=$OFF" --variant 'after=' --json /tmp/tput/r/ab3-burst24.json 2>&1 | grep -v "^INFO\|^DEBUG"
echo "== Poisson 8 req/s, 48 requests"
timeout 130 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 1 --rate 8 \
  --variant "before=$OFF" --variant 'after=' --json /tmp/tput/r/ab3-poisson8.json 2>&1 | grep -v "^INFO\|^DEBUG"

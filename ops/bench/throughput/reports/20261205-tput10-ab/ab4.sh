#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama
NOSB='FERRY_LOOP_SCHED_BATCH=0 FERRY_SUPPORT_SCHED_BATCH=0'
echo "== Poisson 8 req/s, 48 requests"
timeout 285 python ops/bench/throughput/ab.py --model $M --rounds 3 --bursts 1 --rate 8 \
  --variant "before=FERRY_PIPELINE_DEPTH=1 $NOSB FERRY_STREAM_INTERVAL_MS=20" --variant "i50=FERRY_PIPELINE_DEPTH=1 $NOSB" \
  --variant "i50-d2=$NOSB" --variant 'after=' --json /tmp/tput/r/ab4-poisson8.json 2>&1 | grep -v "^INFO\|^DEBUG"

#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama
OFF='FERRY_PIPELINE_DEPTH=1 FERRY_LOOP_SCHED_BATCH=0 FERRY_SUPPORT_SCHED_BATCH=0'
timeout 285 python ops/bench/throughput/ab.py --model $M --rounds 3 --bursts 1 --engine --flops \
  --variant "before=$OFF" --variant 'after=' --variant 'after-i50=FERRY_STREAM_INTERVAL_MS=50' \
  --json /tmp/tput/r/ab2-burst48.json 2>&1 | grep -v "^INFO\|^DEBUG"

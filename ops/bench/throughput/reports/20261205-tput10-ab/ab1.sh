#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama
timeout 280 python ops/bench/throughput/ab.py --model $M --rounds 3 --bursts 1 --engine --flops \
  --variant 'base=' --variant 'd2=FERRY_PIPELINE_DEPTH=2' --variant 'sb=FERRY_SUPPORT_SCHED=batch FERRY_LOOP_SCHED_BATCH=1' \
  --variant 'd2sb=FERRY_PIPELINE_DEPTH=2 FERRY_SUPPORT_SCHED=batch FERRY_LOOP_SCHED_BATCH=1' --json /tmp/tput/r/ab1-burst48.json 2>&1 | grep -v "^INFO\|^DEBUG"

#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama; B=/tmp/tput/main; W=/work/wt/tput; K=$W/.torch-ext
BEFORE="before=PYTHONPATH=$B/libs:$B:$B/.pyshim FERRY_KERNEL_CACHE=$K"
AFTER="after=PYTHONPATH=$W/libs:$W:$W/.pyshim FERRY_KERNEL_CACHE=$K"
echo "== Poisson 2 req/s, 24 requests: which change costs TTFT"
timeout 135 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 1 --rate 2 --num-requests 24 \
  --variant "$AFTER" --variant "nosb=FERRY_KERNEL_CACHE=$K FERRY_LOOP_SCHED_BATCH=0 FERRY_SUPPORT_SCHED_BATCH=0" \
  --variant "d1=FERRY_KERNEL_CACHE=$K FERRY_PIPELINE_DEPTH=1" --json /tmp/tput/r/diag-poisson2.json 2>&1 | grep -v "^INFO\|^DEBUG"
echo "== burst, 24 requests, seeds 1 and 2"
timeout 150 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 2 --num-requests 24 --engine --flops \
  --variant "$BEFORE" --variant "$AFTER" --json /tmp/tput/r/final-burst24.json 2>&1 | grep -v "^INFO\|^DEBUG"

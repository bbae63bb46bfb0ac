#!/bin/bash
cd /work/main && . /work/tools/env.sh
M=/tmp/tput/bench-llama; K=/work/wt/tput/.torch-ext
F4="follow4=FERRY_KERNEL_CACHE=$K FERRY_LOOP_SCHED_BATCH_FROM=4 FERRY_SCHED_BATCH_FROM=4"
A="always=FERRY_KERNEL_CACHE=$K FERRY_LOOP_SCHED_BATCH_FROM=1 FERRY_SCHED_BATCH_FROM=1"
O="off=FERRY_KERNEL_CACHE=$K FERRY_LOOP_SCHED_BATCH_FROM=0 FERRY_SCHED_BATCH_FROM=0"
case $1 in
burst) timeout 280 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 1 \
  --variant "$F4" --variant "$A" --json /tmp/lead/sched2-burst48.json 2>&1 | grep -v "^INFO\|^DEBUG";;
low) timeout 280 python ops/bench/throughput/ab.py --model $M --rounds 1 --bursts 1 --rate 0.5 --num-requests 10 \
  --variant "$F4" --variant "$A" --variant "$O" --json /tmp/lead/sched2-poisson05.json 2>&1 | grep -v "^INFO\|^DEBUG";;
esac

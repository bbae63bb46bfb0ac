#!/bin/bash
cd /work/main && . /work/tools/env.sh
M=/tmp/tput/bench-llama; K=/work/wt/tput/.torch-ext
F="follow=FERRY_KERNEL_CACHE=$K"
A="always=FERRY_KERNEL_CACHE=$K FERRY_LOOP_SCHED_BATCH_FROM=1 FERRY_SCHED_BATCH_FROM=1"
O="off=FERRY_KERNEL_CACHE=$K FERRY_LOOP_SCHED_BATCH_FROM=0 FERRY_SCHED_BATCH_FROM=0"
case $1 in
poisson) timeout 280 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 1 --rate 2 --num-requests 24 \
  --variant "$F" --variant "$A" --variant "$O" --json /tmp/lead/sched-poisson2.json 2>&1 | grep -v "^INFO\|^DEBUG";;
burst) timeout 280 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 1 \
  --variant "$F" --variant "$A" --variant "$O" --json /tmp/lead/sched-burst48.json 2>&1 | grep -v "^INFO\|^DEBUG";;
esac

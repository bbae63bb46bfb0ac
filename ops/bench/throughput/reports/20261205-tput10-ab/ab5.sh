#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama; B=/tmp/tput/main; W=/work/wt/tput; K=$W/.torch-ext
BEFORE="before=PYTHONPATH=$B/libs:$B:$B/.pyshim FERRY_KERNEL_CACHE=$K"
AFTER="after=PYTHONPATH=$W/libs:$W:$W/.pyshim FERRY_KERNEL_CACHE=$K"
echo "== burst, 48 requests"
timeout 190 python ops/bench/throughput/ab.py --model $M --rounds 3 --bursts 1 --engine --flops \
  --variant "$BEFORE" --variant "$AFTER" --json /tmp/tput/r/final-burst48.json 2>&1 | grep -v "^INFO\|^DEBUG"
echo "== Poisson 2 req/s, 24 requests"
timeout 100 python ops/bench/throughput/ab.py --model $M --rounds 2 --bursts 1 --rate 2 --num-requests 24 \
  --variant "$BEFORE" --variant "$AFTER" --json /tmp/tput/r/final-poisson2.json 2>&1 | grep -v "^INFO\|^DEBUG"

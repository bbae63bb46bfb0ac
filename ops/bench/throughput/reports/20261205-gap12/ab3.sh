#!/bin/bash
# The nats/redis niceness again, 3 rounds x 2 bursts (seeds 1, 2), no engine: does the TTFT p50 drop of ab2 hold?
B=/tmp/gap-base; N=/tmp/gap-new; K=/work/wt/gap/.torch-ext; R=/work/wt/gap/ops/bench/throughput/reports/20261205-gap12
cd $N && PYTHONPATH=$N/libs:$N:$N/.pyshim FERRY_KERNEL_CACHE=$K python ops/bench/throughput/ab.py --model smollm2 \
    --rounds 3 --bursts 2 --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" \
    --variant "nice=PYTHONPATH=$N/libs:$N:$N/.pyshim" --json $R/nice-again.json

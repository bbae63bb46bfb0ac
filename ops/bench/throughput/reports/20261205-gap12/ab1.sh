#!/bin/bash
# Candidates, one call: defaults vs --stream-interval-ms 100 vs the one-worker write-back delay 30 s, with the
# in-process engine each round; run from an export of the branch at the profile commit (B=/tmp/gap-base).
B=/tmp/gap-base; K=/work/wt/gap/.torch-ext; R=/work/wt/gap/ops/bench/throughput/reports/20261205-gap12
cd $B && PYTHONPATH=$B/libs:$B:$B/.pyshim FERRY_KERNEL_CACHE=$K python ops/bench/throughput/ab.py --model smollm2 \
    --rounds 2 --bursts 1 --engine --variant 'base=' --variant 'i100=|--stream-interval-ms 100' \
    --variant 'wb30=FERRY_KV_WRITEBACK_DELAY_S=30' --json $R/candidates.json

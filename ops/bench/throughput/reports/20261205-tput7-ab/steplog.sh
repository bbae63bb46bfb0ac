#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama; D=/tmp/tput/sl7; rm -rf $D; mkdir -p $D
export PYTHONPATH=ops/bench/throughput/steplog:$PYTHONPATH
FERRY_ADMISSION_WINDOW_MS=0 FERRY_STEPLOG=$D/w0 timeout 100 python ops/bench/throughput/spy.py --model $M --out $D/spy0 2>&1 | grep burst:
FERRY_STEPLOG=$D/w20 timeout 100 python ops/bench/throughput/spy.py --model $M --out $D/spy20 2>&1 | grep burst:
python ops/bench/throughput/steplog/steplog.py $D/w0.* $D/w20.*
for f in $D/w0.* $D/w20.*; do echo "$f first prefill steps (seqs, prefill tokens):"; awk '$6>0 {printf "%s/%s ", $5, $6}' $f | head -c 300; echo; done

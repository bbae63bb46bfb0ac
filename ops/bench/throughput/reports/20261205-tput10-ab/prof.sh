#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
M=/tmp/tput/bench-llama; D=/tmp/tput/sl10; rm -rf $D; mkdir -p $D
export PYTHONPATH=ops/bench/throughput/steplog:$PYTHONPATH
echo "== base, py-spy on every process"
FERRY_STEPLOG=$D/base timeout 110 python ops/bench/throughput/spy.py --py-spy /work/peers/pyspy-venv/bin/py-spy --model $M --out $D/spy-base --top 10 2>&1 | grep -v "^INFO\|^DEBUG"
echo "== d2 + sched batch, no py-spy"
FERRY_PIPELINE_DEPTH=2 FERRY_SUPPORT_SCHED=batch FERRY_LOOP_SCHED_BATCH=1 FERRY_STEPLOG=$D/d2sb timeout 80 python ops/bench/throughput/spy.py --model $M --out $D/spy-d2sb 2>&1 | grep -v "^INFO\|^DEBUG"
echo "== base, no py-spy"
FERRY_STEPLOG=$D/base2 timeout 80 python ops/bench/throughput/spy.py --model $M --out $D/spy-base2 2>&1 | grep -v "^INFO\|^DEBUG"
python ops/bench/throughput/steplog/steplog.py $D/base.* $D/d2sb.* $D/base2.*

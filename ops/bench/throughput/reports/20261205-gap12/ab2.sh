#!/bin/bash
# One call: (1) step timelines + CPU per thread, engine vs ferry up (branch); (2) nats/redis niceness A/B:
# base = the profile commit (/tmp/gap-base), nice = this branch (/tmp/gap-new), the in-process engine each round.
B=/tmp/gap-base; N=/tmp/gap-new; K=/work/wt/gap/.torch-ext; R=/work/wt/gap/ops/bench/throughput/reports/20261205-gap12
rm -rf /tmp/gap-sl && mkdir -p /tmp/gap-sl
cd $N && PYTHONPATH=$N/ops/bench/throughput/steplog:$N/libs:$N:$N/.pyshim FERRY_KERNEL_CACHE=$K FERRY_STEPLOG=/tmp/gap-sl/run \
    python ops/bench/throughput/spy.py --model smollm2 --engine --out /tmp/gap-prof/sl > $R/steplog-cpu.txt 2>&1
python $N/ops/bench/throughput/steplog/steplog.py /tmp/gap-sl/run.* >> $R/steplog-cpu.txt 2>&1
cp /tmp/gap-prof/sl/cpu.json $R/steplog-cpu.json
cd $N && PYTHONPATH=$N/libs:$N:$N/.pyshim FERRY_KERNEL_CACHE=$K python ops/bench/throughput/ab.py --model smollm2 \
    --rounds 3 --bursts 1 --engine --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" \
    --variant "nice=PYTHONPATH=$N/libs:$N:$N/.pyshim" --json $R/nice.json

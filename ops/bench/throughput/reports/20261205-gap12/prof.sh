#!/bin/bash
# CPU seconds per process and thread under the SmolLM2 48-request burst: the in-process engine, then ferry up
# without py-spy (clean CPU figures), then ferry up with py-spy on every process (where the time goes).
set -e
R=ops/bench/throughput/reports/20261205-gap12
python ops/bench/throughput/spy.py --model smollm2 --engine --out /tmp/gap-prof/cpu > $R/profile-cpu.txt 2>&1
cp /tmp/gap-prof/cpu/cpu.json $R/profile-cpu.json; cp /tmp/gap-prof/cpu/engine.json $R/profile-engine.json
python ops/bench/throughput/spy.py --model smollm2 --py-spy /tmp/gap-pyspy/py_spy-0.4.2.data/scripts/py-spy \
    --out /tmp/gap-prof/spy > $R/profile-spy.txt 2>&1

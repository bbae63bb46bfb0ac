#!/bin/bash
cd /work/wt/tput && . /work/tools/env.sh
R=ops/bench/throughput/reports
timeout 160 python ops/bench/throughput/run.py --systems engine,ferry-up,hf-serve --out $R/20261205-tput10-bench48 2>&1 | grep -v "^INFO\|^DEBUG" | tail -25
timeout 130 python ops/bench/throughput/run.py --systems engine,ferry-up,hf-serve --num-requests 24 --seed 2 --out $R/20261205-tput10-bench24-seed2 2>&1 | grep -v "^INFO\|^DEBUG" | tail -25

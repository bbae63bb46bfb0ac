#!/bin/bash
# The branch as committed: run.py's SmolLM2 burst, engine vs ferry up (the brief's figure), then trace.py on SmolLM2
# (the first token's hops through the layout ferry up picks, the engine in-process paired).
cd /work/wt/gap && R=ops/bench/throughput/reports/20261205-gap12
python ops/bench/throughput/run.py --model smollm2 --systems engine,ferry-up --out $R/run48 > $R/run48.txt 2>&1
python ops/bench/system/trace.py --model smollm2 --requests 24 --engine > $R/trace-smollm2.txt 2>&1

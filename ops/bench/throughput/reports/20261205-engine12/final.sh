#!/bin/bash
# one cpu-bench call: run.py engine,ferry-up on this branch; then the engine A/B base vs this branch, 4 rounds; then linbench
cd /work/wt/engine
PATH=/work/main/.venv/bin:$PATH PYTHONPATH=$PWD/libs:$PWD:$PWD/.pyshim TORCH_EXTENSIONS_DIR=$PWD/.torch-ext \
  timeout 130 python ops/bench/throughput/run.py --systems engine,ferry-up --out ops/bench/throughput/reports/20261205-engine12-run
echo "run.py rc $?"
M=/tmp/engine-h/bench-llama
S=/work/wt/engine/ops/bench/throughput/steps.py
run() {
  local t=$1 d=/tmp/engine-h/$1; [ "$t" = wt ] && d=/work/wt/engine
  echo "== $t"
  (cd $d && PATH=/work/main/.venv/bin:$PATH PYTHONPATH=$d/libs:$d:$d/.pyshim TORCH_EXTENSIONS_DIR=$d/.torch-ext python $S $M steps 2>&1 | grep -v Warning)
}
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="base wt"; else order="wt base"; fi
  for t in $order; do run $t; done
done
PATH=/work/main/.venv/bin:$PATH PYTHONPATH=$PWD/libs:$PWD:$PWD/.pyshim TORCH_EXTENSIONS_DIR=$PWD/.torch-ext timeout 40 python /tmp/engine-h/linbench.py

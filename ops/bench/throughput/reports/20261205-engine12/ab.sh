#!/bin/bash
# engine A/B: ops/bench/throughput/steps.py (this branch's copy) with PYTHONPATH at each tree, alternating
M=/tmp/engine-h/bench-llama
S=/work/wt/engine/ops/bench/throughput/steps.py
run() {  # tree model
  local t=$1 d=/tmp/engine-h/$1; [ "$t" = wt ] && d=/work/wt/engine
  echo "== $t $2"
  (cd $d && PATH=/work/main/.venv/bin:$PATH PYTHONPATH=$d/libs:$d:$d/.pyshim TORCH_EXTENSIONS_DIR=$d/.torch-ext python $S $2 steps 2>&1 | grep -v Warning)
}
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="base c1 wt"; else order="wt c1 base"; fi
  for t in $order; do run $t $M; done
done
if [ -n "$SMOL" ]; then for t in base wt; do run $t smollm2; done; fi

# From the worktree root, with /work/tools/env.sh sourced; BASE: `git archive d3abd4c libs | tar -x -C /tmp/loop/base`
# (the commit before this work). One cpu-bench call each.
R=ops/bench/throughput/reports/20261205x-xeon-step-host
/work/tools/cpu-bench bash -c "python ops/bench/throughput/step_host.py smollm2 --batches 1 4 8 --steps 64 \
  --ab /tmp/loop/base/libs $PWD/libs --rounds 3 --json $R/ab_steps.json && \
  python ops/bench/throughput/step_host.py smollm2 --batches 1 4 8 --steps 64 --profile --json $R/profile_after.json"
/work/tools/cpu-bench python ops/bench/throughput/ab.py --model smollm2 --rounds 2 --bursts 1 --engine \
  --variant "base=PYTHONPATH=/tmp/loop/base/libs:$PWD/libs:$PWD:$PWD/.pyshim" --variant "new=" --json $R/ab_burst.json
# Poisson arrivals, 3 requests/s (one call)
/work/tools/cpu-bench python ops/bench/throughput/ab.py --model smollm2 --rounds 2 --bursts 1 --rate 3 \
  --variant "base=PYTHONPATH=/tmp/loop/base/libs:$PWD/libs:$PWD:$PWD/.pyshim" --variant "new=" --json $R/ab_poisson3.json
# Before profile (its own earlier call, the commit before this work):
# /work/tools/cpu-bench python ops/bench/throughput/step_host.py smollm2 --batches 1 4 8 --steps 64 --profile --json $R/profile_before.json
cd $R && python plot.py   # summary.json, step_host.png

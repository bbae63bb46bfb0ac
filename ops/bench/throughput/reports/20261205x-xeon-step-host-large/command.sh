# From the worktree root, with /work/tools/env.sh sourced; BASE: `git archive ccc566a libs | tar -x -C /tmp/loop2/base`
# (main before this work: the bound calls only below 16 rows). One cpu-bench call per line.
R=ops/bench/throughput/reports/20261205x-xeon-step-host-large
/work/tools/cpu-bench python ops/bench/throughput/step_host.py smollm2 --batches 16 32 48 --steps 32 \
  --ab /tmp/loop2/base/libs $PWD/libs --rounds 2 --json $R/ab_steps.json
/work/tools/cpu-bench python ops/bench/throughput/ab.py --model smollm2 --rounds 2 --bursts 1 --engine \
  --variant "base=PYTHONPATH=/tmp/loop2/base/libs:$PWD/libs:$PWD:$PWD/.pyshim" --variant "new=" --json $R/ab_burst.json
/work/tools/cpu-bench python ops/bench/throughput/ab.py --model smollm2 --rounds 3 --bursts 1 --engine \
  --variant "base=PYTHONPATH=/tmp/loop2/base/libs:$PWD/libs:$PWD:$PWD/.pyshim" --variant "new=" --json $R/ab_burst3.json
/work/tools/cpu-bench python ops/bench/throughput/step_host.py smollm2 --batches 16 32 48 --steps 32 --profile \
  --json $R/profile_after.json
cd $R && python plot.py   # summary.json, step_host.png
# The before profile (its own call, after the others): the same with the base checkout first on PYTHONPATH
/work/tools/cpu-bench env PYTHONPATH=/tmp/loop2/base/libs:$PYTHONPATH python ops/bench/throughput/step_host.py smollm2 \
  --batches 16 32 48 --steps 32 --profile --json $R/profile_before.json
# Poisson arrivals, 3 requests/s (one call, the last)
/work/tools/cpu-bench python ops/bench/throughput/ab.py --model smollm2 --rounds 2 --bursts 1 --rate 3 \
  --variant "base=PYTHONPATH=/tmp/loop2/base/libs:$PWD/libs:$PWD:$PWD/.pyshim" --variant "new=" --json $R/ab_poisson3.json

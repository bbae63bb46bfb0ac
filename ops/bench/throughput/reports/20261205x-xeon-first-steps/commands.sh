# helper `first`, 2026-12-05 16:46-17:30 UTC, 2-core Intel Xeon (AMX, AVX512_BF16, VNNI); SmolLM2-135M-Instruct
# through `ferry up` (ab.py's default system). Every line below is one /work/tools/cpu-bench call (A and B interleaved).
# W = this worktree (wt/first), B = the base d3abd4c exported: git archive d3abd4c | tar -x -C $B; ln -s ../services $B/.pyshim/ferry_services
# (the C++ kernel is the same source in both, built once under $W/.torch-ext = TORCH_EXTENSIONS_DIR)

# 1. before: hop timelines (traced-before-24.json, traced-before-48.json; hops from the trace files)
python ops/bench/throughput/ab.py --model smollm2 --rounds 1 --bursts 1 --num-requests 24 --variant "base=FERRY_TRACE_FILE=/tmp/first/t24.jsonl" --json traced-before-24.json
python ops/bench/throughput/ab.py --model smollm2 --rounds 1 --bursts 1 --num-requests 48 --variant "base=FERRY_TRACE_FILE=/tmp/first/t48.jsonl" --json traced-before-48.json
# 2. the first version (balancer stamp only, b27995f): traced 24 burst, then 48 burst A/B (ab48-hold-only.json)
python ops/bench/throughput/ab.py --model smollm2 --rounds 1 --bursts 1 --num-requests 24 --variant "new=FERRY_TRACE_FILE=/tmp/first/n24.jsonl" --json traced-hold-24.json
python ops/bench/throughput/ab.py --model smollm2 --rounds 3 --bursts 1 --num-requests 48 --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" --variant "first=PYTHONPATH=$W/libs:$W:$W/.pyshim" --json ab48-hold-only.json
# 3. final code (6cc2bde): traced 48 (split off) and 24, then 48 burst base / hold (split off) / split (the default)
python ops/bench/throughput/ab.py --model smollm2 --rounds 1 --bursts 1 --num-requests 48 --variant "hold=FERRY_PREFILL_SPLIT_TOKENS=0 FERRY_TRACE_FILE=/tmp/first/h48.jsonl" --json traced-after-48.json
python ops/bench/throughput/ab.py --model smollm2 --rounds 1 --bursts 1 --num-requests 24 --variant "both=FERRY_TRACE_FILE=/tmp/first/s24.jsonl" --json traced-after-24.json
python ops/bench/throughput/ab.py --model smollm2 --rounds 2 --bursts 1 --num-requests 48 --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" --variant "hold=PYTHONPATH=$W/libs:$W:$W/.pyshim FERRY_PREFILL_SPLIT_TOKENS=0" --variant "split=PYTHONPATH=$W/libs:$W:$W/.pyshim" --json ab48.json
# 4. 24 bursts (seeds 1, 2)
python ops/bench/throughput/ab.py --model smollm2 --rounds 2 --bursts 2 --num-requests 24 --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" --variant "hold=PYTHONPATH=$W/libs:$W:$W/.pyshim FERRY_PREFILL_SPLIT_TOKENS=0" --variant "split=PYTHONPATH=$W/libs:$W:$W/.pyshim" --json ab24.json
# 5. Poisson 3 req/s
python ops/bench/throughput/ab.py --model smollm2 --rounds 2 --bursts 1 --num-requests 48 --rate 3 --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" --variant "split=PYTHONPATH=$W/libs:$W:$W/.pyshim" --json abp3.json
# 6. 48 burst again, with the in-process engine (this tree's engine: split on)
python ops/bench/throughput/ab.py --model smollm2 --rounds 3 --bursts 1 --num-requests 48 --engine --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" --variant "split=PYTHONPATH=$W/libs:$W:$W/.pyshim" --json ab48-engine.json
# 7. 24 bursts again
python ops/bench/throughput/ab.py --model smollm2 --rounds 3 --bursts 2 --num-requests 24 --variant "base=PYTHONPATH=$B/libs:$B:$B/.pyshim" --variant "split=PYTHONPATH=$W/libs:$W:$W/.pyshim" --json ab24-again.json

# hop timelines and plots (the raw trace files, ~0.6 MB each, are not kept):
python ops/bench/throughput/burst_hops.py before-48.jsonl after-48.jsonl --num-requests 48 --json hops-48.json --plot hops-48.png
python ops/bench/throughput/burst_hops.py before-24.jsonl hold-24.jsonl after-24.jsonl --num-requests 24 --json hops-24.json --plot hops-24.png
python plot.py ab48.json ab48-engine.json ab24.json ab24-again.json abp3.json --out ab.png

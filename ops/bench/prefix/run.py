"""Prefix-reuse benchmark: TTFT cold vs store vs pool, and KV transfer hidden behind compute.
The code: ferry.bench.prefix.run; the services it runs in-process are wired in overlap.py here.

    python ops/bench/prefix/run.py --out ops/bench/prefix/reports/<name>
"""

from overlap import measure_overlap

from ferry.bench.prefix.run import main

if __name__ == "__main__":
    main(measure_overlap)

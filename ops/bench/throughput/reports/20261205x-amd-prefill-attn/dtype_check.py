"""Which dtype reaches whole-prompt attention in the SmolLM2 burst: counts the C++ kernel's calls by q dtype.

/work/tools/cpu-run python ops/bench/throughput/reports/20261205x-amd-prefill-attn/dtype_check.py
"""

import collections
import runpy
import sys

from ferry.kernels import cpu_prefill

counts: collections.Counter = collections.Counter()
kernel_call = cpu_prefill.prefill_attention


def counted(q, k, v, scale):
    counts[str(q.dtype)] += 1
    return kernel_call(q, k, v, scale)


cpu_prefill.prefill_attention = counted
sys.argv = ["steps.py", "smollm2", "steps"]
runpy.run_path("ops/bench/throughput/steps.py", run_name="__main__")
print("kernel calls by q dtype:", dict(counts))

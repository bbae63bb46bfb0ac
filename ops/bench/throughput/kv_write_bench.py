"""The fused K/V write (`ferry.kernels.cpu_layers.write_kv`) into a bf16 vs an fp8 cache, and torch's own fp8
conversion path (`attention_ref.write_kv`): 4800 tokens x 3 KV heads x 64 (SmolLM2's), scattered slots, best of 30.

    /work/tools/cpu-bench python ops/bench/throughput/kv_write_bench.py
"""

from __future__ import annotations

import time

import torch

from ferry.kernels import attention_ref as ref
from ferry.kernels.cpu_layers import write_kv


def best_ms(fn, cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> float:
    fn(cache, slots, values)
    best = float("inf")
    for _ in range(30):
        start = time.perf_counter()
        fn(cache, slots, values)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    values = torch.randn(4800, 3, 64)
    slots = torch.randperm(8192 * 16)[:4800]
    sides = (
        ("bf16 fused", torch.bfloat16, write_kv),
        ("fp8 fused", torch.float8_e4m3fn, write_kv),
        ("fp8 torch", torch.float8_e4m3fn, ref.write_kv),
    )
    for name, dtype, fn in sides:
        ms = best_ms(fn, torch.zeros(8192, 16, 3, 64, dtype=dtype), slots, values)
        print(f"write_kv 4800 tokens x 3 heads x 64, {name}: {ms:.3f} ms")


if __name__ == "__main__":
    main()

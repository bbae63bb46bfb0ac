"""The quantized-weight C++ kernel's two paths (register passes, tiled) against oneDNN's packed fp32 GEMM:
GFLOP/s at SmolLM2-135M's matmul shapes and several row counts M (random weights, torch's threads).

    /work/tools/cpu-bench python ops/bench/quant/matmul_rows.py [M,M,...] [bits] > ops/bench/quant/<dir>/matmul_rows.txt
"""

import sys
import time
from collections.abc import Callable

import torch

from ferry.kernels.quant_linear import cpu_quant_matmul
from ferry.kernels.quant_pack import pack_for_cpu
from ferry.kernels.quant_ref import quantize
from ferry.model import cpu_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
NEVER = 10**9  # tiled_from_rows that keeps the register passes


def seconds_per_call(fn: Callable[[], object], budget_s: float = 0.25) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def compare(name: str, n: int, k: int, rows: int, bits: int) -> str:
    w = torch.randn(n, k) * 0.05
    packed, dense = pack_for_cpu(quantize(w, bits, 32)), cpu_linear.pack(w)
    x = torch.randn(rows, k)
    diff = (cpu_quant_matmul(x, packed, NEVER) - cpu_quant_matmul(x, packed, 1)).abs().max().item()
    t_regs = seconds_per_call(lambda: cpu_quant_matmul(x, packed, NEVER))
    t_tiled = seconds_per_call(lambda: cpu_quant_matmul(x, packed, 1))
    t_fp32 = seconds_per_call(lambda: cpu_linear.linear(x, w, None, dense))
    gflop = 2 * rows * n * k / 1e9
    return (
        f"{name:8s} M={rows:5d} int{bits} regs {gflop / t_regs:6.1f} tiled {gflop / t_tiled:6.1f} "
        f"fp32 {gflop / t_fp32:6.1f} GF/s  tiled/regs {t_regs / t_tiled:5.2f}x tiled/fp32 {t_fp32 / t_tiled:5.2f}x "
        f"maxdiff {diff:.2e}"
    )


def main() -> None:
    row_counts = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16,64,512,2048").split(",")]
    bits = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        for rows in row_counts:
            if name != "lm_head" or rows <= 64:  # lm_head runs on the sampled rows only
                print(compare(name, n, k, rows, bits), flush=True)


if __name__ == "__main__":
    main()

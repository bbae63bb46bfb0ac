"""One SmolLM2 layer's seven int4 matmuls at M rows: the int8-activation kernel, bf16 with the weight cached,
and bf16 with the weight dequantized per call (what BF16_FROM_ROWS ships). Weights are cache-resident.

    /work/tools/cpu-bench python ops/bench/quant/20261205-xeon-amx-bf16-prefill/layer_matmuls.py
"""

import time

import torch

from ferry.kernels import quant_linear
from ferry.kernels.quant_linear import pack_cpu, quant_matmul
from ferry.kernels.quant_ref import dequantize, quantize

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def ms(f, n: int = 10) -> float:
    f()
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    torch.set_num_threads(2)
    quant_linear.BF16_FROM_ROWS = 0  # the kernel column is the kernel at every row count
    weights = []
    for n, k in SHAPES:
        qw = quantize(torch.randn(n, k), 4, 32)
        weights.append((qw, pack_cpu(qw), dequantize(qw).to(torch.bfloat16)))
    for rows in (16, 64, 256, 1024, 2048):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        kernel = cached = per_call = 0.0
        for qw, packed, wb in weights:
            x = xs[qw.in_features]
            kernel += ms(lambda x=x, qw=qw, packed=packed: quant_matmul(x, qw, packed=packed))
            cached += ms(lambda x=x, wb=wb: (x.to(torch.bfloat16) @ wb.T).float())
            per_call += ms(lambda x=x, qw=qw: (x.to(torch.bfloat16) @ dequantize(qw, torch.bfloat16).T).float())
        print(f"M={rows}: kernel {kernel:.2f} ms, bf16 cached {cached:.2f} ms, bf16 per call {per_call:.2f} ms")


if __name__ == "__main__":
    main()

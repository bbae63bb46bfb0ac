"""One layer's four matmuls from a bf16 copy at 1700 rows (a burst's prefill step), 512 and 64: ours vs oneDNN;
gate/up and qkv with bf16 out, o and down fp32 out, as BF16_ACTIVATIONS runs them. Best of 5. (The first line of
prefill_ops.txt timed a bf16 silu_and_mul C++ op, since reverted.)

    /work/tools/cpu-bench python ops/bench/quant/20261205d-xeon-amx-bf16-kernel/prefill_ops.py
"""

import time

import torch

from ferry.kernels.cpu_decode import kernel
from ferry.kernels.quant_linear import bf16_copy_matmul, pack_bf16_amx
from ferry.model import cpu_linear

SHAPES = [(960, 576, True), (576, 576, False), (3072, 576, True), (576, 1536, False)]  # [N, K, bf16 out]


def best(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    kernel()
    rows = 1700
    ws = [(torch.randn(n, k) * 0.05).bfloat16() for n, k, _ in SHAPES]
    ours = [pack_bf16_amx(w) for w in ws]
    onednn = [cpu_linear.pack(w) for w in ws]
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    for m in (rows, 512, 64):

        def layer(packs, m=m):
            for (n, k, low), p in zip(SHAPES, packs):
                bf16_copy_matmul(xs[k][:m], p, torch.bfloat16 if low else torch.float32, n)

        print(
            f"one layer's matmuls, {m} rows: ours {best(lambda: layer(ours)):.2f} ms, "
            f"oneDNN {best(lambda: layer(onednn)):.2f} ms"
        )


if __name__ == "__main__":
    main()

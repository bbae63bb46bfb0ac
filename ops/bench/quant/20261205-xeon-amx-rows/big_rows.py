"""Prefill-sized bf16 matmuls with a cached bf16 weight, one SmolLM2 layer's shapes (cache-resident): oneDNN's
packed linear (packed for 16 rows, what QuantLinear.bf16_copy holds; and packed for the call's rows) against
torch.mm on the plain bf16 weight.

    /work/tools/cpu-bench python ops/bench/quant/20261205-xeon-amx-rows/big_rows.py
"""

import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def ms(f, n: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def linear(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), p, None, "none", [], "").float()


def main() -> None:
    ws = [torch.randn(n, k).bfloat16() for n, k in SHAPES]
    p16 = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    for rows in (64, 512, 1024, 2048):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        prow = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
        a = sum(ms(lambda x=xs[w.shape[1]], p=p: linear(x, p)) for w, p in zip(ws, p16))
        b = sum(ms(lambda x=xs[w.shape[1]], p=p: linear(x, p)) for w, p in zip(ws, prow))
        c = sum(ms(lambda x=xs[w.shape[1]], w=w: torch.mm(x.to(torch.bfloat16), w.t()).float()) for w in ws)
        print(f"rows {rows}: packed(16) {a:.2f} ms, packed(rows) {b:.2f} ms, torch.mm {c:.2f} ms", flush=True)


if __name__ == "__main__":
    main()

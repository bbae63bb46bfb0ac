"""CPU decode attention over a paged cache, SmolLM2's shapes (30 layers, 9 query heads on 3 KV heads, head
size 64), fp32 vs bf16 vs fp8 (e4m3) cache: ms for one step's 30 layers (each layer its own cache region, so K/V
stream from memory as in a real step) and the K/V bytes read per second. Best of 5.

    /work/tools/cpu-bench python ops/bench/throughput/decode_attention.py [--json OUT.json] [--shapes 1x300,48x300]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ferry.kernels.cpu_decode import fused_paged_decode_attention

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16
SHAPES = "8x1000,25x450,48x300"
"""(sequences x context tokens): a burst's tail, its middle, its start."""
DTYPES = "float32,bfloat16,float8_e4m3fn"


def step_ms(batch: int, context: int, dtype: torch.dtype) -> tuple[float, float]:
    """-> (ms for the 30 layers, MB of K/V read)."""
    blocks = -(-context // BLOCK)
    num = batch * blocks * LAYERS
    k = torch.randn(num, BLOCK, KV_HEADS, DIM).to(dtype)
    v = torch.randn(num, BLOCK, KV_HEADS, DIM).to(dtype)
    q = torch.randn(batch, HEADS, DIM)
    tables = [torch.arange(i * batch * blocks, (i + 1) * batch * blocks).view(batch, blocks) for i in range(LAYERS)]
    lens = torch.full((batch,), context, dtype=torch.int64)

    def step() -> None:
        for table in tables:
            fused_paged_decode_attention(q, k, v, table, lens, DIM**-0.5)

    step()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
    return best * 1e3, 2 * batch * context * LAYERS * KV_HEADS * DIM * k.element_size() / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--shapes", default=SHAPES, help=f"comma-separated BATCHxCONTEXT (default {SHAPES})")
    p.add_argument("--dtypes", default=DTYPES, help=f"cache dtypes, comma-separated (default {DTYPES})")
    args = p.parse_args()
    rows = []
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    for batch, context in shapes:
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            ms, mb = step_ms(batch, context, dtype)
            rows.append({"batch": batch, "context": context, "kv_dtype": str(dtype)[6:], "ms": ms, "mb_read": mb})
            print(f"batch {batch:3d} context {context:5d} {str(dtype)[6:]:13s} {ms:6.1f} ms  {mb / ms:5.1f} GB/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

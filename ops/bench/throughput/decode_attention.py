"""CPU decode attention over a paged cache, SmolLM2's shapes (30 layers, 9 query heads on 3 KV heads, head
size 64), fp32 vs bf16 vs fp8 (e4m3) cache: ms for one step's 30 layers (each layer its own cache region, so K/V
stream from memory as in a real step) and the K/V bytes read per second. Best of 5. --bf16-dot 0,1: a bf16 cache
through both kernel paths (widening to fp32, and VDPBF16PS: cpu_decode.BF16_DOT), their runs interleaved on the
same tensors so machine noise hits them alike.

    /work/tools/cpu-bench python ops/bench/throughput/decode_attention.py [--json OUT.json] [--shapes 1x300,48x300]
        [--bf16-dot 0,1]
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


def step_ms(batch: int, context: int, dtype: torch.dtype, paths: list[bool | None]) -> tuple[list[float], float]:
    """-> (ms for the 30 layers per path in paths (bf16_dot values, None: the default), MB of K/V read)."""
    blocks = -(-context // BLOCK)
    num = batch * blocks * LAYERS
    k = torch.randn(num, BLOCK, KV_HEADS, DIM).to(dtype)
    v = torch.randn(num, BLOCK, KV_HEADS, DIM).to(dtype)
    q = torch.randn(batch, HEADS, DIM)
    tables = [torch.arange(i * batch * blocks, (i + 1) * batch * blocks).view(batch, blocks) for i in range(LAYERS)]
    lens = torch.full((batch,), context, dtype=torch.int64)

    def step(bf16_dot: bool | None) -> None:
        for table in tables:
            fused_paged_decode_attention(q, k, v, table, lens, DIM**-0.5, bf16_dot=bf16_dot)

    best = [float("inf")] * len(paths)
    for path in paths:
        step(path)
    for _ in range(5):
        for i, path in enumerate(paths):
            started = time.perf_counter()
            step(path)
            best[i] = min(best[i], time.perf_counter() - started)
    return [b * 1e3 for b in best], 2 * batch * context * LAYERS * KV_HEADS * DIM * k.element_size() / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--shapes", default=SHAPES, help=f"comma-separated BATCHxCONTEXT (default {SHAPES})")
    p.add_argument("--dtypes", default=DTYPES, help=f"cache dtypes, comma-separated (default {DTYPES})")
    p.add_argument("--bf16-dot", default="", help="bf16 cache: kernel paths to interleave, e.g. 0,1 ('': the default)")
    args = p.parse_args()
    bf16_paths: list[bool | None] = [bool(int(x)) for x in args.bf16_dot.split(",")] if args.bf16_dot else [None]
    rows = []
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    for batch, context in shapes:
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            paths: list[bool | None] = bf16_paths if dtype == torch.bfloat16 else [None]
            times, mb = step_ms(batch, context, dtype, paths)
            for path, ms in zip(paths, times):
                name = str(dtype)[6:]
                row = {"batch": batch, "context": context, "kv_dtype": name, "bf16_dot": path, "ms": ms, "mb_read": mb}
                rows.append(row)
                label = name if path is None else f"{name} dot={int(path)}"
                print(f"batch {batch:3d} context {context:5d} {label:15s} {ms:6.1f} ms  {mb / ms:5.1f} GB/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

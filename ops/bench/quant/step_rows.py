"""A whole decode step's matmuls, every layer's weights its own (so they stream from memory as in serving,
unlike matmul_rows.py, whose one weight stays in cache): the float kernel's register passes vs its tiled
path vs the int8-activation kernel (csrc/quant_dot.cpp, its default digits) vs oneDNN's packed fp32 GEMM,
per row count M, SmolLM2-135M's shapes (30 layers of fused qkv, o, fused gate/up, down; random weights).
Sets where FERRY_QUANT_TILED_FROM_ROWS should sit and whether FERRY_QUANT_INT8_ACTIVATIONS pays.

    /work/tools/cpu-bench python ops/bench/quant/step_rows.py [--rows 1,4,8,...] [--out DIR]
"""

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ferry.kernels.cpu_decode import march
from ferry.kernels.quant_linear import cpu_quant_matmul, dot_quant_matmul
from ferry.kernels.quant_pack import pack_for_cpu, pack_for_dot
from ferry.kernels.quant_ref import quantize
from ferry.model import cpu_linear

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K]: qkv, o, gate_up, down
NEVER = 10**9  # tiled_from_rows that keeps the register passes


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def quant_step(packed: list, xs: dict[int, torch.Tensor], tiled_from_rows: int) -> None:
    for layer in packed:
        for (_, k), p in zip(SHAPES, layer):
            cpu_quant_matmul(xs[k], p, tiled_from_rows)


def dot_step(packed: list, xs: dict[int, torch.Tensor]) -> None:
    for layer in packed:
        for (_, k), p in zip(SHAPES, layer):
            dot_quant_matmul(xs[k], p)


def fp32_step(dense: list, packed_fp32: list, xs: dict[int, torch.Tensor]) -> None:
    for layer, packs in zip(dense, packed_fp32):
        for (_, k), w, p in zip(SHAPES, layer, packs):
            cpu_linear.linear(xs[k], w, None, p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8,12,16,24,32,64,128", help="row counts M, comma-separated")
    parser.add_argument("--out", type=Path, help="write step_rows.json here")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    packed_fp32 = [[cpu_linear.pack(w) for w in layer] for layer in dense]
    rows_out = []
    for bits in (8, 4):
        quantized = [[quantize(w, bits, 32) for w in layer] for layer in dense]
        packed = [[pack_for_cpu(q) for q in layer] for layer in quantized]
        dots = [[pack_for_dot(q) for q in layer] for layer in quantized]
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}

            row = {
                "bits": bits,
                "rows": m,
                "registers_ms": best_of(partial(quant_step, packed, xs, NEVER)) * 1e3,
                "tiled_ms": best_of(partial(quant_step, packed, xs, 1)) * 1e3,
                "int8_activations_ms": best_of(partial(dot_step, dots, xs)) * 1e3,
                "fp32_onednn_ms": best_of(partial(fp32_step, dense, packed_fp32, xs)) * 1e3,
            }
            rows_out.append(row)
            print(
                f"int{bits} M={m:4d}: registers {row['registers_ms']:7.2f} ms, tiled {row['tiled_ms']:7.2f} ms, "
                f"int8 activations {row['int8_activations_ms']:7.2f} ms, "
                f"fp32 oneDNN {row['fp32_onednn_ms']:7.2f} ms",
                flush=True,
            )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "workload": {"layers": LAYERS, "shapes_nk": SHAPES, "group_size": 32, "timing": "best of 5 whole steps"},
            "machine": {
                "march": march(),
                "int8_activations_isa": torch.ops.ferry_cpu.quant_dot_isa(),
                "platform": platform.platform(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            },
            "rows": rows_out,
        }
        (args.out / "step_rows.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

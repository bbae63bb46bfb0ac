"""A whole SmolLM2 step's int4 matmuls per row count M on an AMX CPU, every layer's weights its own (streamed from
memory as in serving): the int8-activation kernel (what decode runs) on its AVX-512 VNNI loop and on AMX int8
tiles (csrc/quant_dot_amx.h; the same weights also as int8 codes, both ways), bf16 with the weight dequantized per call
(BF16_FROM_ROWS, what prefill runs), a cached bf16 copy of the dequantized weight through torch.mm, the same copy
packed once for oneDNN (mkldnn linear, AMX tiles), the copy packed for our AMX bf16 GEMM (csrc/bf16_amx.h; with
software prefetch 0 / 2 / 8 KB ahead), the same packed copy in our AVX512_BF16 GEMM (csrc/bf16_dot.h, where there is
no AMX; its default prefetch, none, 4 KB ahead), and oneDNN's packed fp32 GEMM for scale (small M only).
Shapes: 30 layers of fused qkv, o, fused gate/up, down, plus lm_head (49152 x 576) once; random weights.

    /work/tools/cpu-bench python ops/bench/quant/amx_rows.py [--rows 1,8,...] [--columns int4_kernel_ms,...] [--out DIR]
"""

import argparse
import json
import platform
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from step_rows import LAYERS, SHAPES, best_of  # the same step, timed the same way

from ferry.kernels.quant_linear import (
    BF16_DOT_PREFETCH,
    amx_int8_usable,
    bf16_amx_usable,
    bf16_dot_usable,
    bf16_quant_matmul,
    dot_quant_matmul,
    pack_bf16_amx,
)
from ferry.kernels.quant_pack import pack_for_dot
from ferry.kernels.quant_ref import dequantize, quantize
from ferry.model import cpu_linear

LM_HEAD = (49152, 576)
FP32_MAX_ROWS = 128


def amx_bf16_matmul(x: torch.Tensor, packed: tuple[torch.Tensor, int], prefetch: int) -> torch.Tensor:
    """Our AMX bf16 GEMM (csrc/bf16_amx.h) with a bf16 copy packed for it, fp32 out, prefetching this far ahead."""
    return torch.ops.ferry_cpu.bf16_amx_linear(x, packed[0], packed[1], False, prefetch)


def dot_bf16_matmul(x: torch.Tensor, packed: tuple[torch.Tensor, int], prefetch: int) -> torch.Tensor:
    """Our AVX512_BF16 GEMM (csrc/bf16_dot.h) with the same packed copy, fp32 out, prefetching this far ahead."""
    return torch.ops.ferry_cpu.bf16_dot_linear(x, packed[0], packed[1], False, prefetch)


def run_step(weights: list, xs: dict[int, torch.Tensor], matmul: Callable) -> None:
    for w in weights:
        matmul(xs[w[0]], w[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,32,64,128,512,2048", help="row counts M, comma-separated")
    parser.add_argument("--columns", help="only these columns, comma-separated (default: all)")
    parser.add_argument("--out", type=Path, help="write amx_rows.json here")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS + [LM_HEAD]
    dense = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    quantized = [quantize(w, 4, 32) for w in dense]
    bf16 = [dequantize(q, torch.bfloat16) for q in quantized]
    int4 = [(q.in_features, pack_for_dot(q)) for q in quantized]
    int8 = [(w.shape[1], pack_for_dot(quantize(w, 8, 32))) for w in dense]
    amx_bf16 = [(w.shape[1], (pack_bf16_amx(w), w.shape[0])) for w in bf16] if bf16_amx_usable() else []
    dot_bf16 = []  # the same layout: one packed copy serves both kernels
    if bf16_dot_usable():
        dot_bf16 = amx_bf16 or [(w.shape[1], (pack_bf16_amx(w), w.shape[0])) for w in bf16]
    vnni, amx = partial(dot_quant_matmul, amx_from_rows=0), partial(dot_quant_matmul, amx_from_rows=1)
    columns: dict[str, tuple[list, Callable]] = {
        "int4_kernel_ms": (int4, vnni),
        "int4_amx_int8_ms": (int4, amx),
        "int8_kernel_ms": (int8, vnni),
        "int8_amx_int8_ms": (int8, amx),
        "bf16_per_call_ms": ([(q.in_features, q) for q in quantized], bf16_quant_matmul),
        "bf16_cached_mm_ms": (
            [(w.shape[1], w) for w in bf16],
            lambda x, w: torch.mm(x.to(torch.bfloat16), w.t()).float(),
        ),
        "bf16_cached_onednn_ms": (
            [(w.shape[1], cpu_linear.pack(w)) for w in bf16],
            lambda x, p: torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), p, None, "none", [], "").float(),
        ),
        "bf16_amx_ms": (amx_bf16, partial(amx_bf16_matmul, prefetch=0)),
        "bf16_amx_prefetch2k_ms": (amx_bf16, partial(amx_bf16_matmul, prefetch=2048)),
        "bf16_amx_prefetch8k_ms": (amx_bf16, partial(amx_bf16_matmul, prefetch=8192)),
        "bf16_dot_ms": (dot_bf16, partial(dot_bf16_matmul, prefetch=BF16_DOT_PREFETCH)),
        "bf16_dot_no_prefetch_ms": (dot_bf16, partial(dot_bf16_matmul, prefetch=0)),
        "bf16_dot_prefetch4k_ms": (dot_bf16, partial(dot_bf16_matmul, prefetch=4096)),
        "fp32_onednn_ms": (
            [(w.shape[1], cpu_linear.pack(w)) for w in dense],
            lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        ),
    }
    if args.columns:
        columns = {name: columns[name] for name in args.columns.split(",")}
    print("AMX int8 tiles usable:", amx_int8_usable(), flush=True)
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        row: dict[str, float | int] = {"rows": m}
        for name, (weights, matmul) in columns.items():
            if (name.startswith("fp32") and m > FP32_MAX_ROWS) or not weights:
                continue
            row[name] = best_of(partial(run_step, weights, xs, matmul), 5 if m <= 128 else 2) * 1e3
        rows_out.append(row)
        print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "workload": {"layers": LAYERS, "shapes_nk": SHAPES, "lm_head_nk": LM_HEAD, "bits": 4, "group_size": 32},
            "columns": "int8_* : the same weights quantized to int8; *_kernel_ms: the VNNI loop (amx_from_rows=0), "
            "*_amx_int8_ms: the AMX int8 tiles (amx_from_rows=1); the rest int4",
            "amx_int8_usable": amx_int8_usable(),
            "timing": "best of 5 whole steps (2 from 512 rows)",
            "machine": {
                "platform": platform.platform(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            },
            "rows": rows_out,
        }
        (args.out / "amx_rows.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""SiLU-and-mul on bf16 gate/up rows (the MLP activation between two bf16 copy matmuls on AMX): ATen's
silu then mul (two ops, two roundings, a temporary) against the C++ op (csrc/cpu_layers.cpp), at SmolLM2's
width (2 x 1536) for a decode step's rows and a prefill step's. Interleaved, median of repeats, one process.

    /work/tools/cpu-bench python ops/bench/throughput/silu_bf16.py --out ops/bench/throughput/reports/NAME
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ferry.kernels import cpu_layers


def _aten(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _time_ms(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="report folder (silu_bf16.json, silu_bf16.png)")
    ap.add_argument("--width", type=int, default=1536, help="intermediate size (SmolLM2: 1536)")
    ap.add_argument("--rows", default="16,32,48,256,1024,2048", help="comma-separated row counts")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, 2 * args.width).bfloat16()
        repeats = max(20, 20000 // rows)
        aten, fused = [], []
        for _ in range(3):  # A B A B A B
            aten.append(_time_ms(_aten, x, repeats))
            fused.append(_time_ms(cpu_layers.silu_and_mul, x, repeats))
        row = {"rows": rows, "aten_ms": min(aten), "fused_ms": min(fused)}
        row["speedup"] = row["aten_ms"] / row["fused_ms"]
        results.append(row)
        print(f"rows {rows:5d}  aten {row['aten_ms']:.3f} ms  fused {row['fused_ms']:.3f} ms  {row['speedup']:.2f}x")
    meta = {"torch_threads": torch.get_num_threads(), "width": args.width, "torch": torch.__version__}
    (out / "silu_bf16.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rows_list, [r["aten_ms"] for r in results], "o-", label="ATen silu then mul (bf16)")
    ax.plot(rows_list, [r["fused_ms"] for r in results], "o-", label="ferry_cpu::silu_and_mul (bf16)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"SiLU-and-mul, bf16 rows of 2 x {args.width}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "silu_bf16.png", dpi=120)


if __name__ == "__main__":
    main()

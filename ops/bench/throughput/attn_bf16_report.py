"""The "attn" round's report: the VDPBF16PS decode path's accuracy against attention_ref's fp32 math (random q
and caches, SmolLM2's GQA 9/3 at head size 64 and a 128 case), next to what rounding K/V to bf16 already costs
against an fp32 cache; and one PNG of the round's speed JSONs (decode attention, decode step, widening vs
VDPBF16PS). No timing here: the speed JSONs come from kernel_ab.sh / decode_step_profile.py under cpu-bench.

    python ops/bench/throughput/attn_bf16_report.py REPORT_DIR     # under /work/tools/cpu-run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ferry.kernels import attention_ref as ref
from ferry.kernels.cpu_decode import fused_paged_decode_attention as fused

BS = 16
LENS = [1, 17, 33, 300, 1000]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def accuracy(dim: int, heads: int, kv_heads: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    cols = max(-(-n // BS) for n in LENS)
    tables = torch.randperm(len(LENS) * cols, generator=gen).view(len(LENS), cols)
    k32, v32 = (torch.randn(len(LENS) * cols, BS, kv_heads, dim, generator=gen) for _ in "kv")
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    q, lens, scale = torch.randn(len(LENS), heads, dim, generator=gen), torch.tensor(LENS), dim**-0.5
    exact = ref.paged_decode_attention(q, k16.float(), v16.float(), tables, lens, scale)
    fp32_cache = ref.paged_decode_attention(q, k32, v32, tables, lens, scale)
    paths = {name: fused(q, k16, v16, tables, lens, scale, bf16_dot=flag) for name, flag in (("widen", 0), ("dot", 1))}
    return {
        "dim": dim,
        "heads": heads,
        "kv_heads": kv_heads,
        "lens": LENS,
        "rel_error_vs_exact": {name: rel(out, exact) for name, out in paths.items()},
        "max_abs_error_vs_exact": {name: (out - exact).abs().max().item() for name, out in paths.items()},
        "rel_error_bf16_cache_vs_fp32_cache": rel(exact, fp32_cache),
    }


def plot(report: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    attn = json.loads((report / "decode_attention.json").read_text())["rows"]
    labels = sorted({(r["batch"], r["context"]) for r in attn})
    for offset, dot in ((-0.2, False), (0.2, True)):
        ms = [
            next(r["ms"] for r in attn if (r["batch"], r["context"]) == lab and r["bf16_dot"] == dot) for lab in labels
        ]
        axes[0].bar([i + offset for i in range(len(labels))], ms, 0.4, label="VDPBF16PS" if dot else "widen to fp32")
    axes[0].set_xticks(range(len(labels)), [f"{b}x{c}" for b, c in labels])
    axes[0].set(title="decode attention, 30 layers (batch x context)", ylabel="ms (best of 5)")
    steps = [
        r
        for name in ("decode_step_300.json", "decode_step_1000.json")
        for r in json.loads((report / name).read_text())["rows"]
    ]
    cases = sorted({(r["batch"], r["context"]) for r in steps})
    for offset, dot in ((-0.2, False), (0.2, True)):
        ms = [
            next(r["step_p50_ms"] for r in steps if (r["batch"], r["context"]) == c and r["bf16_dot"] == dot)
            for c in cases
        ]
        axes[1].bar([i + offset for i in range(len(cases))], ms, 0.4, label="VDPBF16PS" if dot else "widen to fp32")
    axes[1].set_xticks(range(len(cases)), [f"{b}x{c}" for b, c in cases])
    axes[1].set(title="SmolLM2 engine decode step p50 (batch x context)", ylabel="ms")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(report / "attn_bf16.png", dpi=110)


def main() -> None:
    report = Path(sys.argv[1])
    rows = [accuracy(64, 9, 3, 0), accuracy(64, 9, 3, 1), accuracy(128, 8, 2, 2)]
    (report / "accuracy.json").write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(json.dumps(row))
    plot(report)


if __name__ == "__main__":
    main()

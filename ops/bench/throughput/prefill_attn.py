"""Causal prefill attention of one whole prompt on the CPU, SmolLM2's shapes (9 query heads on 3 KV heads, head
size 64): the C++ kernel (ferry.kernels.cpu_prefill) vs the path it replaces (attention_ref.prefill_attention:
repeat_interleave of K/V + torch's SDPA), fp32 and bf16 q/k/v, interleaved call by call on the same tensors so
machine noise hits both alike. q/k/v are slices of one [L, 15, 64] projection output, as the engine hands them
(bf16: each converted once, as dense_attention does for a step's whole prompts). Median of `--rounds` rounds of
`--calls` calls (30: one prompt's layers); GFLOP/s counts the causal half only (4 * H * D * L(L+1)/2).

    /work/tools/cpu-bench python ops/bench/throughput/prefill_attn.py [--lengths 50,150,400,600] [--threads 1]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ferry.kernels import attention_ref, cpu_prefill

HEADS, KV_HEADS, DIM = 9, 3, 64


def inputs(length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = torch.randn(length, HEADS + 2 * KV_HEADS, DIM)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    return (q, k, v) if dtype == torch.float32 else (q.to(dtype), k.to(dtype), v.to(dtype))


def paths() -> dict:
    scale = DIM**-0.5
    return {
        "torch_sdpa": lambda q, k, v: attention_ref.prefill_attention(q, k, v, 0, scale),
        "ours": lambda q, k, v: cpu_prefill.prefill_attention(q, k, v, scale),
    }


def measure(length: int, dtype: torch.dtype, rounds: int, calls: int) -> dict[str, float]:
    """-> median ms per call of each path."""
    q, k, v = inputs(length, dtype)
    fns = paths()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(q, k, v)
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            for _ in range(calls):
                fn(q, k, v)
            times[name].append((time.perf_counter() - started) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="50,150,400,600")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert cpu_prefill.prefill_usable(*inputs(4, torch.float32), None), "the C++ prefill kernel is not built"
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for length in (int(n) for n in args.lengths.split(",")):
            ms = measure(length, dtype, args.rounds, args.calls)
            gflop = 4 * HEADS * DIM * length * (length + 1) / 2 / 1e9
            row = {"dtype": name, "length": length, **{f"{k}_ms": v for k, v in ms.items()}}
            row["speedup"] = ms["torch_sdpa"] / ms["ours"]
            row["ours_gflops"], row["torch_sdpa_gflops"] = gflop / ms["ours"] * 1e3, gflop / ms["torch_sdpa"] * 1e3
            rows.append(row)
            print(
                f"{name:9s} L={length:4d}  sdpa {ms['torch_sdpa']:7.3f} ms ({row['torch_sdpa_gflops']:5.1f} GFLOP/s)"
                f"  ours {ms['ours']:7.3f} ms ({row['ours_gflops']:5.1f} GFLOP/s)  {row['speedup']:.2f}x",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"threads": torch.get_num_threads(), "bf16_dot": cpu_prefill.prefill_bf16_dot_built()}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

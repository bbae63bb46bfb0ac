"""A/B of versions of the int8-activation kernel (csrc/quant_dot.cpp) on SmolLM2's decode shapes, in one process.

Each variant is a git revision of the csrc folder (or WORK, the working tree) plus optional -D flags, built as its
own library whose op namespace is ferry_dot_<name> (the file's TORCH_LIBRARY_FRAGMENT(ferry_cpu) renamed), with
the flags the kernel cache uses (cpu_decode.cflags()). Every variant gets the same packed weights and inputs;
rounds alternate the variants, and each (shape, rows) reports the best time of its rounds per variant, plus
whether every variant's output equals the first one's bit for bit.

Shapes: SmolLM2-135M's int4 (Q4_1-style, group 32, with offsets) qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576 (LAYERS copies of each, so the weights stream from memory as in a step), lm_head 576->49152.

    /work/tools/cpu-run python ops/bench/throughput/vnni_ab.py --build old=87d6d4b new=WORK
    /work/tools/cpu-bench python ops/bench/throughput/vnni_ab.py old=87d6d4b new=WORK [--out DIR]
"""

import argparse
import hashlib
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from ferry.kernels.cpu_decode import HEADERS, cflags
from ferry.kernels.quant_pack import pack_for_dot
from ferry.kernels.quant_ref import quantize

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = [1, 4, 8, 16, 24, 32, 48, 64]
CSRC = "libs/ferry/kernels/csrc"
ROOT = Path(__file__).resolve().parents[3]


def source(rev: str, name: str) -> str:
    if rev == "WORK":
        return (ROOT / CSRC / name).read_text()
    return subprocess.run(
        ["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def build(spec: str):
    """name=rev[:-DFLAG,...] -> the variant's quant_dot_linear op."""
    from torch.utils.cpp_extension import load

    name, _, rest = spec.partition("=")
    rev, _, flags = rest.partition(":")
    defines = [f for f in flags.split(",") if f]
    files = {n: source(rev, n) for n in ["quant_dot.cpp", *(h.name for h in HEADERS)]}
    files["quant_dot.cpp"] = files["quant_dot.cpp"].replace(
        "TORCH_LIBRARY_FRAGMENT(ferry_cpu, m)", f"TORCH_LIBRARY(ferry_dot_{name}, m)"
    )
    digest = hashlib.sha256("".join(files.values()).encode() + " ".join(defines + cflags()).encode()).hexdigest()
    directory = ROOT / ".torch-ext" / f"vnni_ab_{name}_{digest[:12]}"
    directory.mkdir(parents=True, exist_ok=True)
    for n, text in files.items():
        (directory / n).write_text(text)
    load(
        name=f"vnni_ab_{name}_{digest[:12]}",
        sources=[str(directory / "quant_dot.cpp")],
        extra_cflags=[*cflags(), *defines],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )
    return name, getattr(torch.ops, f"ferry_dot_{name}").quant_dot_linear.default


def packed_weights(gen: torch.Generator) -> dict[str, list]:
    out: dict[str, list] = {}
    for shape, (n, k) in SHAPES.items():
        copies = 1 if shape == "lm_head" else LAYERS
        out[shape] = []
        for _ in range(copies):
            qw = quantize(torch.randn(n, k, generator=gen) * 0.02, 4, 32)
            qw.offsets = torch.randn(n, k // 32, generator=gen) * 0.01  # Q4_1-style offsets
            p = pack_for_dot(qw)
            out[shape].append((p.codes, p.scales, p.offsets, 4, 32, n, 2, 0))
    return out


def time_shape(op, weights: list, x: torch.Tensor, calls: int) -> float:
    """Seconds per call over `calls` calls cycling through the layers' weights."""
    start = time.perf_counter()
    for i in range(calls):
        op(x, *weights[i % len(weights)])
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="name=rev[:-DFLAG,...]; rev WORK is the working tree")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--build", action="store_true", help="only build the variants (run under cpu-run)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ops = dict(build(v) for v in args.variants)
    if args.build:
        return
    gen = torch.Generator().manual_seed(0)
    weights = packed_weights(gen)
    results: list[dict] = []
    for m in (int(r) for r in args.rows.split(",")):
        for shape, (n, k) in SHAPES.items():
            x = torch.randn(m, k, generator=gen)
            outs = {name: op(x, *weights[shape][0]) for name, op in ops.items()}
            first = next(iter(outs.values()))
            same = all(torch.equal(o, first) for o in outs.values())
            calls = 8 if shape == "lm_head" else 2 * LAYERS
            best = {name: float("inf") for name in ops}
            for _ in range(args.rounds):
                for name, op in ops.items():
                    best[name] = min(best[name], time_shape(op, weights[shape], x, calls))
            gop = 2 * m * n * k / 1e9
            row: dict = {
                "shape": shape,
                "rows": m,
                "n": n,
                "k": k,
                "bit_identical": same,
                "us": {name: t * 1e6 for name, t in best.items()},
                "gop_per_s": {name: gop / t for name, t in best.items()},
            }
            results.append(row)
            names = list(ops)
            ratio = " ".join(f"{name} {best[names[0]] / best[name]:.3f}x" for name in names[1:])
            print(
                f"M={m:3d} {shape:8s} "
                + " ".join(f"{name} {best[name] * 1e6:8.1f} us" for name in names)
                + f"  {ratio}  {'same' if same else 'DIFFERENT'}",
                flush=True,
            )
    totals = {name: sum(r["us"][name] * (1 if r["shape"] == "lm_head" else LAYERS) for r in results) for name in ops}
    print(
        "step-weighted total (30 layers + lm_head, all row counts):",
        " ".join(f"{name} {t / 1e3:.2f} ms" for name, t in totals.items()),
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "variants": args.variants,
            "rounds": args.rounds,
            "layers": LAYERS,
            "machine": {
                "platform": platform.platform(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
            },
            "results": results,
            "step_weighted_total_ms": {n: t / 1e3 for n, t in totals.items()},
        }
        (args.out / "vnni_ab.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

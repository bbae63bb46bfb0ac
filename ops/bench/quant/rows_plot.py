"""Plot an amx_rows.py report: ms per whole SmolLM2 step's matmuls against rows M, one line per column (log-log),
with the time the bf16 copy's bytes take at a given memory speed for scale.

    python ops/bench/quant/rows_plot.py DIR/amx_rows.json --out DIR/amx_rows.png [--gbs 23] \\
        [--machine "2-core Xeon (AMX)"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BF16_COPY_BYTES = 2 * (30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) + 49152 * 576)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gbs", type=float, default=23.0, help="memory speed for the reference line, GB/s")
    p.add_argument("--machine", default="2-core Xeon (AMX)", help="the machine measured, for the title")
    args = p.parse_args()
    rows = json.loads(args.report.read_text())["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in [k for k in rows[0] if k.endswith("_ms")]:
        pts = [(r["rows"], r[name]) for r in rows if name in r]
        ax.plot([m for m, _ in pts], [t for _, t in pts], "o-", label=name.removesuffix("_ms"))
    ax.axhline(BF16_COPY_BYTES / args.gbs / 1e6, color="grey", ls="--", label=f"bf16 copy bytes at {args.gbs:g} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows M")
    ax.set_ylabel("ms per step's matmuls (30 layers + lm_head)")
    ax.set_title(f"SmolLM2-135M step matmuls, weights streamed, {args.machine}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

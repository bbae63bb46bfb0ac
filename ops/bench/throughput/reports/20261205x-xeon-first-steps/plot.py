"""TTFT p50 and output tok/s per variant and burst of this folder's ab.py reports, one column per report.

python ops/bench/throughput/reports/20261205x-xeon-first-steps/plot.py ab48.json ab24.json abp3.json --out ab.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    fig, axes = plt.subplots(2, len(args.reports), figsize=(5 * len(args.reports), 7), squeeze=False)
    for col, path in enumerate(args.reports):
        doc = json.loads(path.read_text())
        names = list(doc["results"])
        for row, (key, unit) in enumerate([("ttft_p50_ms", "TTFT p50 ms"), ("tok_s", "output tok/s")]):
            ax = axes[row][col]
            for i, name in enumerate(names):
                values = [r[key] for r in doc["results"][name]]
                ax.scatter([i] * len(values), values, alpha=0.6)
                mean = sum(values) / len(values)
                ax.hlines(mean, i - 0.3, i + 0.3, colors="k")
                ax.annotate(f"{mean:.0f}", (i + 0.32, mean), va="center", fontsize=8)
            ax.set_xticks(range(len(names)), names)
            ax.set_xlim(-0.5, len(names) - 0.2)
            ax.set_ylabel(unit)
            if row == 0:
                ax.set_title(f"{path.stem} ({doc['rate']})")
    fig.suptitle("SmolLM2 through ferry up, 2-core Xeon (AMX): every burst, mean as a bar")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

"""Plot ab.py reports: output tok/s of every variant per round and burst, one panel per JSON file.

python ops/bench/throughput/ab_plot.py A.json B.json ... --out ab.png
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
    fig, axes = plt.subplots(1, len(args.reports), figsize=(5 * len(args.reports), 4), squeeze=False)
    for ax, path in zip(axes[0], args.reports):
        doc = json.loads(path.read_text())
        for name, rows in doc["results"].items():
            xs = [r["round"] + 0.1 * (r["seed"] - 1) for r in rows]
            fig_ = doc.get("summary", {}).get(name, {})
            label = name + (f" ({fig_['over_engine']:.2f} of engine)" if "over_engine" in fig_ else "")
            ax.plot(xs, [r["tok_s"] for r in rows], "o-", label=label)
        ax.set_title(path.stem, fontsize=9)
        ax.set_xlabel("round (+0.1 per burst seed)")
        ax.set_ylabel("output tok/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

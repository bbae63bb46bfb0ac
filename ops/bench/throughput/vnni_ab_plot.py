"""Plot of vnni_ab.py's JSON: each variant's speedup over the first, per shape, against rows.

python ops/bench/throughput/vnni_ab_plot.py REPORT_DIR/vnni_ab.json REPORT_DIR/vnni_ab.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    report = json.loads(open(sys.argv[1]).read())
    names = [v.split("=")[0] for v in report["variants"]]
    shapes = sorted({r["shape"] for r in report["results"]}, key=[r["shape"] for r in report["results"]].index)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for shape in shapes:
        rows = [r for r in report["results"] if r["shape"] == shape]
        for name in names[1:]:
            left.plot(
                [r["rows"] for r in rows],
                [r["us"][names[0]] / r["us"][name] for r in rows],
                marker="o",
                label=f"{shape}" if len(names) == 2 else f"{shape} {name}",
            )
        for name in names:
            right.plot(
                [r["rows"] for r in rows],
                [r["gop_per_s"][name] for r in rows],
                marker="o",
                linestyle="-" if name != names[0] else ":",
                label=f"{shape} {name}",
            )
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set(xlabel="rows (M)", ylabel=f"speedup over {names[0]}", title="int4 x 2-digit int8 activations")
    right.set(xlabel="rows (M)", ylabel="model GOP/s (2 M N K / t)", title="rate (2 cores; 2-digit peak ~469)")
    left.legend(fontsize=7)
    right.legend(fontsize=6, ncol=2)
    fig.suptitle("quant_dot_linear, SmolLM2 shapes, 2-core AMD EPYC (Zen 4, AVX-512 VNNI, no AMX)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()

"""Plot decode_attention.py's and decode_step_profile.py's JSON side by side: ms per KV cache dtype.

python ops/bench/throughput/kv_fp8_plot.py ATTENTION.json STEP.json --out kv_fp8.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def bars(ax, rows: list[dict], label_of, dtype_key: str, value_key: str, title: str) -> None:
    labels = list(dict.fromkeys(label_of(r) for r in rows))
    dtypes = list(dict.fromkeys(r[dtype_key] for r in rows))
    width = 0.8 / len(dtypes)
    for i, dtype in enumerate(dtypes):
        values = {label_of(r): r[value_key] for r in rows if r[dtype_key] == dtype}
        ax.bar([x + i * width for x in range(len(labels))], [values.get(k, 0) for k in labels], width, label=dtype)
    ax.set_xticks([x + width * (len(dtypes) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("attention", type=Path)
    p.add_argument("step", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    attention, step = json.loads(args.attention.read_text()), json.loads(args.step.read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars(
        left,
        attention["rows"],
        lambda r: f"{r['batch']}x{r['context']}",
        "kv_dtype",
        "ms",
        "decode attention, 30 layers (batch x context)",
    )
    step_title = "engine decode step p50 (batch)"
    bars(right, step["rows"], lambda r: str(r["batch"]), "kv_cache_dtype", "step_p50_ms", step_title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

"""amx_rows.json -> amx_rows.png (ms per SmolLM2 step's matmuls by row count) and engine_ab.txt -> engine_ab.png.

python ops/bench/quant/20261205c-xeon-amx-int8/plot.py
"""

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
report = json.loads((HERE / "amx_rows.json").read_text())
rows = [r["rows"] for r in report["rows"]]
fig, ax = plt.subplots(figsize=(8, 5))
for name in ("int4_kernel_ms", "int4_amx_int8_ms", "int8_kernel_ms", "int8_amx_int8_ms", "bf16_cached_onednn_ms"):
    ax.plot(rows, [r[name] for r in report["rows"]], marker="o", label=name.removesuffix("_ms"))
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("rows (sequences in a decode step)")
ax.set_ylabel("ms per SmolLM2 step's matmuls (weights streamed)")
ax.set_title("int8-activation kernel: VNNI loop vs AMX int8 tiles (2-core Xeon)")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.savefig(HERE / "amx_rows.png", dpi=100, bbox_inches="tight")

RUN = r"== FERRY_QUANT_AMX_INT8=(\d+).*?\n.*?([\d.]+) tok/s\n.*?prefill.*?([\d.]+) s.*?\n.*?decode>8.*?([\d.]+) s"
runs = re.findall(RUN, (HERE / "engine_ab.txt").read_text())
fig, ax = plt.subplots(figsize=(8, 4))
for i, (setting, tps, _, decode) in enumerate(runs):
    ax.bar(i, float(decode), color="tab:blue" if setting == "0" else "tab:orange")
    ax.text(i, float(decode), f"{float(tps):.0f} tok/s", ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(len(runs)), [f"{'off' if s == '0' else 'on'} #{i // 2 + 1}" for i, (s, *_) in enumerate(runs)])
ax.set_ylabel("s in decode steps of > 8 sequences")
ax.set_title("SmolLM2 burst, in-process engine: AMX int8 off / on, interleaved")
fig.savefig(HERE / "engine_ab.png", dpi=100, bbox_inches="tight")

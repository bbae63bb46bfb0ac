"""ab1_base_c1_wt.txt + final_runpy_ab_linbench.txt -> ab.json, ab.png (engine tok/s per tree and run)."""

import collections
import json
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent


def parse(path: Path) -> dict:
    runs: dict = collections.defaultdict(list)
    name = None
    for line in path.read_text().splitlines():
        if m := re.match(r"== (\S+)(?: (\S+))?", line):
            name = m.group(1) + (" smollm2" if m.group(2) == "smollm2" else "")
        elif name and (m := re.match(r"wall ([\d.]+) s, \d+ tokens, ([\d.]+) tok/s, TTFT p50 ([\d.]+) s", line)):
            wall, tok_s, ttft = (float(g) for g in m.groups())
            runs[name].append({"wall_s": wall, "tok_s": tok_s, "ttft_p50_s": ttft})
        elif name and (m := re.match(r"\s+(\S+)\s+steps\s+\d+\s+([\d.]+) s", line)):
            runs[name][-1][m.group(1) + "_s"] = float(m.group(2))
    return dict(runs)


calls = {
    "call1 (3 rounds)": parse(HERE / "ab1_base_c1_wt.txt"),
    "call2 (4 rounds)": parse(HERE / "final_runpy_ab_linbench.txt"),
}


def mean_tok_s(runs: list[dict]) -> float:
    return round(statistics.mean(r["tok_s"] for r in runs), 1)


summary = {call: {t: {"runs": r, "mean_tok_s": mean_tok_s(r)} for t, r in c.items()} for call, c in calls.items()}
(HERE / "ab.json").write_text(json.dumps(summary, indent=1) + "\n")
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, (call, c) in zip(axes, summary.items()):
    trees = [t for t in c if "smollm2" not in t]
    for i, t in enumerate(trees):
        vals = [r["tok_s"] for r in c[t]["runs"]]
        ax.scatter([i] * len(vals), vals, label=t)
        ax.hlines(statistics.mean(vals), i - 0.3, i + 0.3)
    ax.set_xticks(range(len(trees)), trees)
    ax.set_title(f"bench checkpoint, engine burst, {call}")
axes[0].set_ylabel("output tok/s (steps.py)")
fig.tight_layout()
fig.savefig(HERE / "ab.png", dpi=100)
for call, c in summary.items():
    print(call, {t: v["mean_tok_s"] for t, v in c.items()})

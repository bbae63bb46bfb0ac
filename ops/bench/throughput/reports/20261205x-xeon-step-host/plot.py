"""summary.json + step_host.png from ab_steps.json and the two profiles (python plot.py, in this folder)."""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
ab = json.loads((here / "ab_steps.json").read_text())
base_key, new_key = (k for k in ab if "/tmp/" in k), (k for k in ab if "/tmp/" not in k)
runs = {"before": ab[next(base_key)], "after": ab[next(new_key)]}
profiles = {name: json.loads((here / f"profile_{name}.json").read_text()) for name in runs}
batches = list(runs["before"][0]["batches"])
summary: dict = {"card": "2-core Xeon (AMX), 1 torch thread, SmolLM2-135M Q4_1 GGUF", "batches": {}}
for b in batches:
    row = {}
    for name, docs in runs.items():
        steps = [doc["batches"][b]["step_ms"] for doc in docs]
        prof = profiles[name]["batches"][b]
        row[name] = {
            "step_ms_median_of_rounds": statistics.median(steps),
            "step_ms_rounds": steps,
            "profiled_step_ms": prof["profiled_step_ms"],
            "kernel_ms": prof["kernel_ms"],
            "other_ops_ms": prof["other_ops_ms"],
        }
    row["after_over_before"] = row["after"]["step_ms_median_of_rounds"] / row["before"]["step_ms_median_of_rounds"]
    row["greedy_tokens_identical"] = all(
        doc["batches"][b]["tokens_head"] == runs["before"][0]["batches"][b]["tokens_head"]
        for docs in runs.values()
        for doc in docs
    )
    summary["batches"][b] = row
(here / "summary.json").write_text(json.dumps(summary, indent=1))

fig, ax = plt.subplots(figsize=(7, 4))
width = 0.38
for j, name in enumerate(runs):
    xs = [i + (j - 0.5) * width for i in range(len(batches))]
    steps = [summary["batches"][b][name]["step_ms_median_of_rounds"] for b in batches]
    kernels = [min(summary["batches"][b][name]["kernel_ms"], s) for b, s in zip(batches, steps)]
    ax.bar(xs, kernels, width, color=f"C{j}", alpha=0.9, label=f"{name}: in kernels (profiled)")
    ax.bar(
        xs,
        [s - k for s, k in zip(steps, kernels)],
        width,
        bottom=kernels,
        color=f"C{j}",
        alpha=0.35,
        label=f"{name}: host (rest of the step)",
    )
    for x, s in zip(xs, steps):
        ax.text(x, s + 0.3, f"{s:.1f}", ha="center", fontsize=8)
ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
ax.set_ylabel("decode step, ms (median)")
ax.set_title("SmolLM2 decode step, before vs after (one call, 3 rounds alternated)")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(here / "step_host.png", dpi=120)

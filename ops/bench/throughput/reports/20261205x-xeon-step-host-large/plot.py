"""summary.json + step_host.png from ab_steps.json (and profile_*.json where present), and the burst calls
(python plot.py, in this folder)."""

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
profiles = {
    name: json.loads((here / f"profile_{name}.json").read_text())
    for name in runs
    if (here / f"profile_{name}.json").exists()
}
batches = list(runs["before"][0]["batches"])
summary: dict = {"card": "2-core Xeon (AMX), 1 torch thread, SmolLM2-135M Q4_1 GGUF", "batches": {}, "bursts": {}}
for b in batches:
    row: dict = {}
    for name, docs in runs.items():
        steps = [doc["batches"][b]["step_ms"] for doc in docs]
        row[name] = {"step_ms_median_of_rounds": statistics.median(steps), "step_ms_rounds": steps}
        if name in profiles:
            prof = profiles[name]["batches"][b]
            row[name].update({k: prof[k] for k in ("profiled_step_ms", "kernel_ms", "other_ops_ms")})
    row["after_over_before"] = row["after"]["step_ms_median_of_rounds"] / row["before"]["step_ms_median_of_rounds"]
    row["greedy_tokens_identical"] = all(
        doc["batches"][b]["tokens_head"] == runs["before"][0]["batches"][b]["tokens_head"]
        for docs in runs.values()
        for doc in docs
    )
    summary["batches"][b] = row
for path in sorted(here.glob("ab_burst*.json")):
    summary["bursts"][path.name] = json.loads(path.read_text())["summary"]
if (here / "ab_poisson3.json").exists():
    summary["poisson_3_per_s"] = json.loads((here / "ab_poisson3.json").read_text())["summary"]
(here / "summary.json").write_text(json.dumps(summary, indent=1))

fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
width = 0.38
for j, name in enumerate(runs):
    xs = [i + (j - 0.5) * width for i in range(len(batches))]
    steps = [summary["batches"][b][name]["step_ms_median_of_rounds"] for b in batches]
    ax.bar(xs, steps, width, color=f"C{j}", alpha=0.8, label=name)
    if name in profiles:
        kernels = [min(summary["batches"][b][name]["kernel_ms"], s) for b, s in zip(batches, steps)]
        ax.scatter(xs, kernels, color="k", marker="_", s=200, label=f"{name}: in kernels (profiled)")
    for x, s in zip(xs, steps):
        ax.text(x, s + 0.5, f"{s:.1f}", ha="center", fontsize=8)
ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
ax.set_ylabel("decode step, ms (median of rounds)")
ax.set_title("SmolLM2 decode step (bf16 copy rows), one call alternated")
ax.legend(fontsize=7)
names = list(summary["bursts"])
for j, variant in enumerate(("base", "new", "engine")):
    xs = [i + (j - 1) * 0.27 for i in range(len(names))]
    vals = [summary["bursts"][n][variant]["tok_s"] for n in names]
    bx.bar(xs, vals, 0.27, color=f"C{j}", label=variant)
    for x, v in zip(xs, vals):
        bx.text(x, v + 5, f"{v:.0f}", ha="center", fontsize=8)
bx.set_xticks(range(len(names)), names, fontsize=7)
bx.set_ylabel("output tok/s (48 burst)")
bx.set_title("ferry up vs in-process engine")
bx.legend(fontsize=7)
fig.tight_layout()
fig.savefig(here / "step_host.png", dpi=120)

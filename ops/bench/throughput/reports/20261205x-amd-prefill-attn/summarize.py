"""summary.json and prefill_attn.png from this folder's prefill_attn.json, engine_ab.txt and prefill_ops_{0,1}.txt.

python ops/bench/throughput/reports/20261205x-amd-prefill-attn/summarize.py
"""

import json
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent


def engine_runs(path: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    setting = None
    for line in path.read_text().splitlines():
        if m := re.match(r"== FERRY_PREFILL_ATTN_CPP=(\d)", line):
            setting = m.group(1)
        elif m := re.match(r"wall ([\d.]+) s, (\d+) tokens, ([\d.]+) tok/s, TTFT p50 ([\d.]+) s", line):
            runs[setting].append(
                {"wall_s": float(m[1]), "tokens": int(m[2]), "tok_s": float(m[3]), "ttft_p50_s": float(m[4])}
            )
        elif m := re.match(r"\s+(prefill|decode>8|decode<=8)\s+steps\s+\d+\s+([\d.]+) s", line):
            runs[setting][-1][f"{m[1]}_s"] = float(m[2])
    return runs


def attention_ops(path: Path) -> dict[str, float]:
    """Self CPU seconds of the whole-prompt attention ops in a prefill-ops profile."""
    out = {}
    for line in path.read_text().splitlines():
        for op in (
            "aten::_scaled_dot_product_flash_atten",
            "ferry_cpu::prefill_attention",
            "aten::repeat_interleave",
            "aten::copy_",
            "mkldnn::_linear_pointwise",
        ):
            if line.strip().startswith(op):
                cols = re.split(r"\s{2,}", line.strip())
                value = cols[2]
                out[op] = float(value[:-2]) / 1000 if value.endswith("ms") else float(value[:-1])
    return out


def main() -> None:
    micro = json.loads((HERE / "prefill_attn.json").read_text())
    runs = engine_runs(HERE / "engine_ab.txt")
    means = {k: {f: statistics.mean(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    summary = {
        "machine": "2-core AMD EPYC (Zen 4), AVX-512 + VNNI + AVX512_BF16, no AMX",
        "microbench": micro,
        "engine_ab": {"off": runs["0"], "on": runs["1"], "mean_off": means["0"], "mean_on": means["1"]},
        "prefill_ops_self_s": {
            "off": attention_ops(HERE / "prefill_ops_0.txt"),
            "on": attention_ops(HERE / "prefill_ops_1.txt"),
        },
    }
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for dtype, marker in (("bfloat16", "o"), ("float32", "s")):
        rows = [r for r in micro["rows"] if r["dtype"] == dtype]
        xs = [r["length"] for r in rows]
        a.plot(xs, [r["torch_sdpa_gflops"] for r in rows], marker + "--", label=f"{dtype} repeat_interleave + SDPA")
        a.plot(xs, [r["ours_gflops"] for r in rows], marker + "-", label=f"{dtype} C++ kernel")
    a.set(
        xlabel="prompt tokens",
        ylabel="GFLOP/s (causal half)",
        title="prefill attention, SmolLM2 shapes (9/3 heads, D 64)",
    )
    a.legend(fontsize=7)
    for key, name in (("0", "off (SDPA)"), ("1", "on (C++)")):
        b.plot(range(1, len(runs[key]) + 1), [r["prefill_s"] for r in runs[key]], "o-", label=f"prefill steps, {name}")
        b.plot(range(1, len(runs[key]) + 1), [r["wall_s"] for r in runs[key]], "s:", label=f"burst wall, {name}")
    b.set(xlabel="round (interleaved)", ylabel="s", title="SmolLM2 48-burst in-process (steps.py)", ylim=(0, None))
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "prefill_attn.png", dpi=110)
    print(json.dumps({k: summary[k] for k in ("engine_ab", "prefill_ops_self_s")}, indent=1)[:3000])


if __name__ == "__main__":
    main()

"""throughput.json / throughput.md / throughput.png of one run.py invocation: issue #22's targets
as ratios of figures measured side by side in that one run."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = (
    # numerator, denominator, figure, bar, claim
    ("ferry-up", "engine", "output_tokens_per_s", 0.85, "`ferry up` >= 85% of the in-process engine"),
    ("ferry-up", "hf-serve", "output_tokens_per_s", 4.0, "`ferry up` >= 4x `transformers serve --continuous-batching`"),
    ("ferry-generate", "hf-static", "output_tokens_per_s", 3.0, "offline: `ferry generate` >= 3x transformers static"),
    ("engine", "matmul", "model_gflops", 0.6, "engine: model FLOPs delivered >= 60% of the matmul rate"),
    ("ferry-up", "matmul", "model_gflops", 0.6, "`ferry up`: model FLOPs delivered >= 60% of the matmul rate"),
    ("ferry-up", "llamacpp", "output_tokens_per_s", 2.0, "`ferry up` >= 2x llama.cpp's server (same GGUF)"),
    ("ferry-up", "vllm", "output_tokens_per_s", 2.0, "`ferry up` >= 2x vLLM's CPU build (same weights)"),
)
PEER_NAMES = {"llamacpp": "llama.cpp's server", "vllm": "vLLM's CPU build"}
TTFT_BOUND = ("hf-serve", *PEER_NAMES)  # bars against these servers hold only at equal or lower TTFT p50


def _targets(systems: dict[str, dict]) -> list[tuple]:
    """TARGETS, plus each `ferry up` variant against each peer (llama.cpp, vLLM) when both ran."""
    rows = list(TARGETS)
    for name in systems:
        for peer, label in PEER_NAMES.items():
            if name.startswith("ferry-up:") and peer in systems:
                rows.append((name, peer, "output_tokens_per_s", 2.0, f"`{name}` >= 2x {label}"))
    return rows


def targets(meta: dict, systems: dict[str, dict]) -> list[dict]:
    rows = []
    for num, den, figure, bar, claim in _targets(systems):
        a = (systems.get(num) or {}).get(figure)
        b = meta["machine_matmul_gflops"] if den == "matmul" else (systems.get(den) or {}).get(figure)
        value = a / b if a and b else None
        row = {"claim": claim, "numerator": num, "denominator": den, "figure": figure, "bar": bar, "value": value}
        row["met"] = None if value is None else value >= bar
        if den in TTFT_BOUND and value is not None:  # the bar holds at equal or lower TTFT p50
            ttft = [(systems[s]["ttft_ms"] or {}).get("p50") for s in (num, den)]
            row["ttft_p50_ms"] = ttft
            row["met"] = row["met"] and ttft[0] is not None and ttft[1] is not None and ttft[0] <= ttft[1]
        rows.append(row)
    return rows


def write(out: Path, meta: dict, systems: dict[str, dict], problems: dict[str, str]) -> None:
    rows = targets(meta, systems)
    doc = {"meta": meta, "targets": rows, "systems": systems, "problems": problems}
    (out / "throughput.json").write_text(json.dumps(doc, indent=1))
    (out / "throughput.md").write_text(markdown(meta, systems, problems, rows))
    plot(out / "throughput.png", meta, systems)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _weights(system: dict) -> str:
    return f" ({_fmt(system['weight_gflops'])})" if system.get("weight_gflops") is not None else ""


def markdown(meta: dict, systems: dict, problems: dict, rows: list[dict]) -> str:
    lines = [f"# Burst throughput, {meta['date_utc']}", "", f"Workload: {meta['workload']}.", ""]
    lines += [
        f"Machine dense matmul rate: {meta['machine_matmul_gflops']:.1f} GFLOP/s ({meta['cpu_cores']} cores).",
        "Model FLOPs: 2 x matmul parameters per prompt and output token, plus attention's Q K^T and P V "
        "(2 x 2 x context x width per token and layer); weights only in parentheses.",
        "",
    ]
    lines += ["| target | value | bar | met |", "|---|---|---|---|"]
    for r in rows:
        extra = (
            f" (TTFT p50 {_fmt(r['ttft_p50_ms'][0], 0)} vs {_fmt(r['ttft_p50_ms'][1], 0)} ms)"
            if "ttft_p50_ms" in r
            else ""
        )
        met = "not measured" if r["met"] is None else ("yes" if r["met"] else "no")
        lines.append(f"| {r['claim']} | {_fmt(r['value'], 2)}{extra} | {r['bar']} | {met} |")
    lines += ["", "| system | output tok/s | wall s | output tokens | TTFT p50 ms | TTFT p99 ms | model GFLOP/s |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for name, s in systems.items():
        ttft = s.get("ttft_ms") or {}
        lines.append(
            f"| {name} | {_fmt(s['output_tokens_per_s'])} | {_fmt(s['wall_s'])} | {s['output_tokens']} | "
            f"{_fmt(ttft.get('p50'), 0)} | {_fmt(ttft.get('p99'), 0)} | {_fmt(s['model_gflops'])}{_weights(s)} |"
        )
    if meta.get("ferry_up_variants"):
        lines += [
            "",
            "`ferry up` variants: " + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in meta["ferry_up_variants"].items()),
        ]
    lines += _greedy(systems)
    if problems:
        lines += ["", "## Problems", *[f"- {k}: {v[:500]}" for k, v in problems.items()]]
    lines += [
        "",
        f"Stages (load average at start, wall s): `{json.dumps(meta['stages'])}`",
        "",
        "![burst](throughput.png)",
        "",
    ]
    return "\n".join(lines)


def _greedy(systems: dict) -> list[str]:
    """The systems' greedy texts side by side, one row per prompt, and whether each equals the first's."""
    from ferry.bench.throughput.greedy import PROMPTS

    names = [n for n, s in systems.items() if s.get("greedy_texts")]
    if not names:
        return []
    lines = ["", "## Greedy texts (chat, temperature 0, 32 tokens)", ""]
    lines += ["| prompt | " + " | ".join(names) + " | agree |", "|---" * (len(names) + 2) + "|"]
    for i, prompt in enumerate(PROMPTS):
        texts = [systems[n]["greedy_texts"][i] for n in names]
        cells = [t.replace("|", "\\|").replace("\n", " ") for t in texts]
        agree = ", ".join(n for n, t in zip(names[1:], texts[1:], strict=True) if t == texts[0]) or "none"
        lines.append(f"| {prompt} | " + " | ".join(cells) + f" | equal to {names[0]}: {agree} |")
    return lines


def plot(path: Path, meta: dict, systems: dict[str, dict]) -> None:
    from ferry.bench.plots import pyplot

    plt = pyplot()

    names = list(systems)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, [systems[n]["output_tokens_per_s"] or 0 for n in names], color="tab:blue")
    left.set_xlabel("output tokens/s (burst; offline rows: whole process)")
    left.invert_yaxis()
    ttft = [((systems[n].get("ttft_ms") or {}).get("p50") or 0) / 1000 for n in names]
    right.barh(names, ttft, color="tab:orange")
    right.set_xlabel("TTFT p50 (s)")
    right.invert_yaxis()
    fig.suptitle(f"{meta['workload'][:90]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)

"""The comparison report: one row per (system, phase), and the ratios BENCHMARKS.md asks for.

Pure arithmetic on phase summaries (the dicts `ferry.bench.report.summarize` and
`ferry.bench.offline.RunResult.summary` produce: output_tokens_per_s, requests_per_s, ttft_ms,
tpot_ms, e2e_ms), plus the markdown and one PNG. No servers, no torch.
"""

from __future__ import annotations

import math
from pathlib import Path

# (numerator, denominator, what the ratio answers)
PAIRS = (
    ("engine-dynamic", "engine-static", "continuous vs static batching, same engine (BENCHMARKS.md #1)"),
    ("ferry-up", "hf-serve", "ferry served vs `transformers serve --continuous-batching`, both over HTTP (#2)"),
    ("engine-dynamic", "hf-serve", "ferry's engine in-process vs `transformers serve --continuous-batching` (#2)"),
    ("ferry-up", "engine-dynamic", "distributed system vs the same engine in-process: cost of the split (#3)"),
)
FIGURES = (("output_tokens_per_s", "output tok/s", "higher"), ("requests_per_s", "req/s", "higher"),
           ("ttft_ms.p50", "TTFT p50", "lower"), ("ttft_ms.p99", "TTFT p99", "lower"),
           ("tpot_ms.p50", "TPOT p50", "lower"), ("tpot_ms.p99", "TPOT p99", "lower"),
           ("e2e_ms.p99", "E2E p99", "lower"))


def figure(summary: dict, key: str) -> float | None:
    """`summary['ttft_ms']['p50']` for key 'ttft_ms.p50'; None when missing."""
    value: object = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def ratios(systems: dict[str, dict[str, dict]]) -> list[dict]:
    """systems: name -> phase name -> summary. One entry per PAIRS pair and phase both systems ran."""
    out = []
    for num, den, meaning in PAIRS:
        for phase in sorted(set(systems.get(num, {})) & set(systems.get(den, {}))):
            a, b = systems[num][phase], systems[den][phase]
            values = {}
            for key, _, _ in FIGURES:
                x, y = figure(a, key), figure(b, key)
                values[key] = x / y if x is not None and y else None
            out.append({"numerator": num, "denominator": den, "phase": phase, "meaning": meaning,
                        "ratios": values})
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(meta: dict, systems: dict[str, dict[str, dict]], problems: dict[str, str], pairs: list[dict]) -> str:
    lines = ["# ferry comparison run", "", *[f"- {k}: {v}" for k, v in meta.items()], "",
             "## Figures (latencies in ms)", "",
             "| system | phase | ok/total | " + " | ".join(label for _, label, _ in FIGURES) + " |",
             "|---|---|---|" + "---|" * len(FIGURES)]
    for name, phases in systems.items():
        for phase, s in phases.items():
            ok = f"{s.get('num_ok', s.get('num_requests'))}/{s.get('num_requests')}"
            cells = [_fmt(figure(s, key), 2 if key == "requests_per_s" else 1) for key, _, _ in FIGURES]
            lines.append(f"| {name} | {phase} | {ok} | " + " | ".join(cells) + " |")
    lines += ["", "## Ratios (numerator / denominator, same phase, same run)", "",
              "| numerator / denominator | phase | " + " | ".join(label for _, label, _ in FIGURES) + " |",
              "|---|---|" + "---|" * len(FIGURES)]
    for p in pairs:
        cells = [_fmt(p["ratios"][key], 2) for key, _, _ in FIGURES]
        lines.append(f"| {p['numerator']} / {p['denominator']} | {p['phase']} | " + " | ".join(cells) + " |")
    lines += ["", "Throughput ratios > 1 and latency ratios < 1 favour the numerator.", ""]
    lines += [f"- `{num} / {den}`: {meaning}" for num, den, meaning in PAIRS]
    if problems:
        lines += ["", "## Systems that did not run", ""] + [f"- **{k}**: {v}" for k, v in problems.items()]
    return "\n".join(lines) + "\n"


def plot(path: Path, systems: dict[str, dict[str, dict]]) -> bool:
    """Grouped bars: output tokens/s of every system in every phase."""
    phases = sorted({p for s in systems.values() for p in s})
    if not phases:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(systems))
    for i, (name, by_phase) in enumerate(systems.items()):
        xs = [j + i * width for j, ph in enumerate(phases) if ph in by_phase]
        ys = [figure(by_phase[ph], "output_tokens_per_s") or 0.0 for ph in phases if ph in by_phase]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], phases)
    ax.set_ylabel("output tokens/s")
    ax.set_title("same checkpoint, same workload, one run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

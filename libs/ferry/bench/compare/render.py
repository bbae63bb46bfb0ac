"""compare.md and compare.png from the run's figures, ratios and targets (no servers, no torch).

The headline table answers issue #9 row by row: which target, which two systems, the measured
speedup or reduction, the bar and whether it is met. The context tables follow the phase rule of
ratios.py: throughput from the all-at-once phase, latency from the Poisson phase.
"""

from __future__ import annotations

from pathlib import Path

from ferry.bench.compare import ratios as r
from ferry.bench.report import fmt

FIGURE_COLUMNS = (
    ("output_tokens_per_s", "output tok/s"),
    ("requests_per_s", "req/s"),
    ("ttft_ms.p50", "TTFT p50"),
    ("ttft_ms.p99", "TTFT p99"),
    ("tpot_ms.p50", "TPOT p50"),
    ("tpot_ms.p99", "TPOT p99"),
    ("e2e_ms.p99", "E2E p99"),
)
CLOCK_NOTE = (
    "Clocks: `engine` systems run in this process, taking turns step by step, each timed by its own "
    "step clock (the wall time of its own steps, plus jumps over idle gaps to the next arrival): what that "
    "engine would show running alone, on one process with `--threads` threads, at the speed it got during "
    "this run; all at once there are no gaps, so it is the wall time of its steps back to back. `wall` "
    "systems are timed by the HTTP client's wall clock, streaming included. Rows marked `wall/engine` "
    "compare the two: they were measured minutes apart (see the load averages above), and `ferry up` runs "
    "a prefill and a decode worker, so it can use two processes' worth of cores where an in-process engine "
    "uses one. "
    "Such a row is exactly (ferry-up / engine-dynamic, the cost or gain of the split, two clocks) x "
    "(engine-dynamic / the baseline, one clock); both factors are in the tables below."
)


def speedup_or_reduction(value: float | None, kind: str) -> str:
    """'3.12x' for a throughput speedup, '47%' for a latency reduction (negative: the numerator is slower)."""
    if value is None:
        return "–"
    return f"{value:.2f}x" if kind == r.ALL_AT_ONCE else f"{100 * value:.0f}%"


def _bar(threshold: float, kind: str) -> str:
    return f">= {threshold:g}x" if kind == r.ALL_AT_ONCE else f">= {100 * threshold:.0f}% lower"


def _met(met: bool | None) -> str:
    return "not measured" if met is None else ("**yes**" if met else "no")


def targets_table(rows: list[dict]) -> list[str]:
    lines = [
        "| issue #9 target | numerator / denominator | phase | clocks | measured | bar | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in rows:
        figure = r.THROUGHPUT_FIGURES.get(t["figure"]) or r.LATENCY_FIGURES[t["figure"]]
        lines.append(
            f"| {t['claim']} | {t['numerator']} / {t['denominator']} ({figure}) | {t['phase'] or '–'} "
            f"| {t['clocks']} | {speedup_or_reduction(t['value'], t['kind'])} "
            f"| {_bar(t['threshold'], t['kind'])} | {_met(t['met'])} |"
        )
    return lines


def load_lines(systems: dict[str, dict[str, dict]]) -> list[str]:
    """How hard each Poisson rate pushed each system, and a warning for those it saturated: their
    latency there measures a growing queue, not a moderate load."""
    lines = []
    for phase, fractions in r.poisson_loads(systems).items():
        shown = ", ".join(f"{name} {fraction:.2f}" for name, fraction in fractions.items())
        lines += [f"{phase}'s nominal rate as a fraction of each system's all-at-once req/s: {shown}."]
        saturated = [name for name, fraction in fractions.items() if fraction >= 1]
        if saturated:
            lines += [
                f"**Saturated at this rate: {', '.join(saturated)}** (offered load >= its capacity; "
                "its latency in this phase is queueing, not a moderate load)."
            ]
        lines += [""]
    return lines


def ratio_tables(pairs: list[dict]) -> list[str]:
    lines = []
    for kind, figures, title in (
        (r.ALL_AT_ONCE, r.THROUGHPUT_FIGURES, "Capacity: all requests at once (speedup, > 1x favours the numerator)"),
        (
            r.POISSON,
            r.LATENCY_FIGURES,
            "Latency at the Poisson rate (how much lower the numerator's is; negative = higher)",
        ),
    ):
        rows = [p for p in pairs if p["kind"] == kind]
        lines += [
            "",
            f"## {title}",
            "",
            "| numerator / denominator | phase | clocks | " + " | ".join(figures.values()) + " | answers |",
            "|---|---|---|" + "---|" * (len(figures) + 1),
        ]
        for p in rows:
            cells = [speedup_or_reduction(p["values"].get(key), kind) for key in figures]
            lines.append(
                f"| {p['numerator']} / {p['denominator']} | {p['phase']} | {p['clocks']} | "
                + " | ".join(cells)
                + f" | {p['meaning']} |"
            )
    return lines


def figures_table(systems: dict[str, dict[str, dict]]) -> list[str]:
    lines = [
        "| system | clock | phase | ok/total | out tokens | " + " | ".join(l for _, l in FIGURE_COLUMNS) + " |",
        "|---|---|---|---|---|" + "---|" * len(FIGURE_COLUMNS),
    ]
    for name in [s for s in r.SYSTEMS if s in systems]:
        for phase, s in systems[name].items():
            ok = f"{s.get('num_ok', s.get('num_requests'))}/{s.get('num_requests')}"
            cells = [fmt(r.figure(s, key), 2 if key == "requests_per_s" else 1) for key, _ in FIGURE_COLUMNS]
            lines.append(
                f"| {name} | {r.CLOCKS[name]} | {phase} | {ok} | {s.get('output_tokens', '–')} | "
                + " | ".join(cells)
                + " |"
            )
    return lines


def markdown(
    meta: dict,
    systems: dict[str, dict[str, dict]],
    problems: dict[str, str],
    pairs: list[dict],
    target_rows: list[dict],
) -> str:
    lines = [
        "# ferry comparison run",
        "",
        *[f"- {k}: {v}" for k, v in meta.items()],
        "",
        "## Issue #9 targets",
        "",
        *targets_table(target_rows),
        "",
        *load_lines(systems),
        CLOCK_NOTE,
    ]
    lines += ratio_tables(pairs)
    lines += [
        "",
        "## Figures (latencies in ms)",
        "",
        "In the Poisson phase every system that keeps up delivers the offered load, so its tok/s and "
        "req/s only say that it kept up.",
        "",
        *figures_table(systems),
    ]
    if problems:
        lines += ["", "## Systems or phases that did not run", ""] + [f"- **{k}**: {v}" for k, v in problems.items()]
    return "\n".join(lines) + "\n"


def plot(path: Path, systems: dict[str, dict[str, dict]]) -> bool:
    """Left: output tok/s all at once (capacity). Right: p99 E2E and TTFT p99 at the Poisson rate."""
    names = [s for s in r.SYSTEMS if s in systems]
    if not names:
        return False
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    tput = [r.figure(systems[n].get(r.ALL_AT_ONCE, {}), "output_tokens_per_s") or 0.0 for n in names]
    left.bar(range(len(names)), tput, color="tab:blue")
    left.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    left.set_ylabel("output tokens/s")
    left.set_title("capacity: all requests at once")
    for j, (key, label) in enumerate((("e2e_ms.p99", "E2E p99"), ("ttft_ms.p99", "TTFT p99"))):
        values = [_poisson_figure(systems[n], key) or 0.0 for n in names]
        right.bar([i + 0.4 * j for i in range(len(names))], [v / 1000 for v in values], 0.4, label=label)
    right.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=20, fontsize=8)
    right.set_ylabel("seconds")
    poisson = sorted({p for by_phase in systems.values() for p in by_phase if r.phase_kind(p) == r.POISSON})
    right.set_title(f"latency at {poisson[0] if poisson else 'the Poisson rate (not run)'}")
    right.legend(fontsize=8)
    save_figure(fig, path)
    return True


def _poisson_figure(by_phase: dict[str, dict], key: str) -> float | None:
    phases = sorted(p for p in by_phase if r.phase_kind(p) == r.POISSON)
    return r.figure(by_phase[phases[0]], key) if phases else None


def rerender(folder: Path) -> None:
    """compare.md and compare.png again from `folder`/compare.json's figures, with today's ratio
    definitions (its meta and problems kept)."""
    import json

    doc = json.loads((folder / "compare.json").read_text())
    systems, problems = doc["systems"], doc.get("problems", {})
    pairs, target_rows = r.ratios(systems), r.targets(systems)
    (folder / "compare.json").write_text(json.dumps({**doc, "targets": target_rows, "ratios": pairs}, indent=1))
    plot(folder / "compare.png", systems)
    (folder / "compare.md").write_text(
        markdown(doc["meta"], systems, problems, pairs, target_rows) + "\n![capacity and latency](compare.png)\n"
    )


if __name__ == "__main__":
    import sys

    rerender(Path(sys.argv[1]))

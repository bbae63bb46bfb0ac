"""The comparison's ratios: which system is compared with which, in which phase, on which figure,
and whether issue #9's targets are met.

A phase answers one kind of question. All requests at once saturates every system, so it measures
capacity: throughput ratios (numerator / denominator, > 1 favours the numerator) come from it only.
At a moderate Poisson rate every system keeps up, so throughput equals the offered load and says
nothing; that phase compares latency: p99 end-to-end, TTFT p50/p99, as a reduction
(1 - numerator / denominator, > 0 favours the numerator). Pure arithmetic on phase summaries (the
dicts `ferry.bench.report.summarize` and `ferry.bench.offline.RunResult.summary` produce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SYSTEMS = ("engine-static-padded", "engine-static", "engine-dynamic", "ferry-up", "hf-serve")
CLOCKS = {
    "engine-static-padded": "engine",
    "engine-static": "engine",
    "engine-dynamic": "engine",
    "ferry-up": "wall",
    "hf-serve": "wall",
}
"""engine: the in-process engine's own step clock (its work plus idle gaps); wall: HTTP client wall clock."""
ALL_AT_ONCE, POISSON = "all-at-once", "poisson"
THROUGHPUT_FIGURES = {"output_tokens_per_s": "output tok/s", "requests_per_s": "req/s"}
LATENCY_FIGURES = {
    "e2e_ms.p99": "E2E p99",
    "ttft_ms.p50": "TTFT p50",
    "ttft_ms.p99": "TTFT p99",
    "tpot_ms.p50": "TPOT p50",
}


@dataclass(frozen=True, slots=True)
class Target:
    """One of issue #9's bars, as a comparison of two systems on one figure in one kind of phase."""

    numerator: str
    denominator: str
    figure: str
    """A key of THROUGHPUT_FIGURES (compared as a speedup) or LATENCY_FIGURES (as a reduction)."""
    threshold: float
    """Met when the speedup / reduction is >= this."""
    claim: str
    """The issue's words, plus which baseline this row uses."""


_X3 = "distributed >= 3x static batching, output tok/s offline"
_P99 = "distributed >= 45% lower p99 E2E at a moderate Poisson rate"
_X4 = "distributed >= 4x `transformers serve --continuous-batching`"
TARGETS = (
    Target("ferry-up", "engine-static-padded", "output_tokens_per_s", 3.0, f"{_X3} (classic padded)"),
    Target("ferry-up", "engine-static", "output_tokens_per_s", 3.0, f"{_X3} (compacting, the stronger one)"),
    Target(
        "engine-dynamic",
        "engine-static-padded",
        "output_tokens_per_s",
        3.0,
        "same claim, same engine in-process (one clock): continuous vs classic static",
    ),
    Target("ferry-up", "engine-static-padded", "e2e_ms.p99", 0.45, f"{_P99} (classic padded)"),
    Target("ferry-up", "engine-static", "e2e_ms.p99", 0.45, f"{_P99} (compacting, the stronger one)"),
    Target(
        "engine-dynamic",
        "engine-static-padded",
        "e2e_ms.p99",
        0.45,
        "same claim, same engine in-process (one clock): continuous vs classic static",
    ),
    Target("ferry-up", "hf-serve", "output_tokens_per_s", 4.0, f"{_X4}, output tok/s offline (both over HTTP)"),
)

# (numerator, denominator, what the comparison answers), for the context tables.
PAIRS = (
    ("engine-dynamic", "engine-static-padded", "continuous vs classic static batching, same engine (BENCHMARKS.md #1)"),
    ("engine-dynamic", "engine-static", "continuous vs compacting static batching, same engine (#1)"),
    ("engine-static", "engine-static-padded", "what compacting finished slots alone buys static batching"),
    ("ferry-up", "engine-static-padded", "the whole system vs classic static batching in-process (#1, two clocks)"),
    ("ferry-up", "engine-static", "the whole system vs compacting static batching in-process (#1, two clocks)"),
    ("ferry-up", "hf-serve", "ferry served vs `transformers serve --continuous-batching`, both over HTTP (#2)"),
    ("engine-dynamic", "hf-serve", "ferry's engine in-process vs `transformers serve` (#2, two clocks)"),
    ("ferry-up", "engine-dynamic", "distributed system vs the same engine in-process: cost of the split (#3)"),
)


def phase_kind(phase: str) -> str:
    """'all-at-once' or 'poisson' from a phase name (ferry.bench.online.make_plans names them)."""
    if phase == ALL_AT_ONCE:
        return ALL_AT_ONCE
    if phase.startswith("poisson"):
        return POISSON
    raise ValueError(f"phase {phase!r}: expected 'all-at-once' or 'poisson-<rate>rps'")


def figure(summary: dict, key: str) -> float | None:
    """`summary['ttft_ms']['p50']` for key 'ttft_ms.p50'; None when missing."""
    value: object = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def compare(numerator: dict, denominator: dict, key: str) -> float | None:
    """Speedup num/den for a throughput figure, reduction 1 - num/den for a latency; None when
    either figure is missing or the denominator is 0."""
    x, y = figure(numerator, key), figure(denominator, key)
    if x is None or not y:
        return None
    return x / y if key in THROUGHPUT_FIGURES else 1.0 - x / y


def figures_for(phase: str) -> dict[str, str]:
    """What a phase can answer: capacity when all arrive at once, latency at a Poisson rate."""
    return THROUGHPUT_FIGURES if phase_kind(phase) == ALL_AT_ONCE else LATENCY_FIGURES


def ratios(systems: dict[str, dict[str, dict]]) -> list[dict]:
    """systems: name -> phase name -> summary. One entry per PAIRS pair and phase both systems ran,
    holding only the figures that phase answers."""
    out = []
    for num, den, meaning in PAIRS:
        for phase in sorted(set(systems.get(num, {})) & set(systems.get(den, {}))):
            a, b = systems[num][phase], systems[den][phase]
            values = {key: compare(a, b, key) for key in figures_for(phase)}
            out.append(
                {
                    "numerator": num,
                    "denominator": den,
                    "phase": phase,
                    "kind": phase_kind(phase),
                    "clocks": f"{CLOCKS[num]}/{CLOCKS[den]}",
                    "meaning": meaning,
                    "values": values,
                }
            )
    return out


def targets(systems: dict[str, dict[str, dict]]) -> list[dict]:
    """Every TARGETS row with its measured value and `met` (None: not measured in this run)."""
    out = []
    for t in TARGETS:
        kind = ALL_AT_ONCE if t.figure in THROUGHPUT_FIGURES else POISSON
        phases: list[str | None] = [
            *sorted(
                p
                for p in set(systems.get(t.numerator, {})) & set(systems.get(t.denominator, {}))
                if phase_kind(p) == kind
            )
        ] or [None]
        for phase in phases:
            value = (
                None if phase is None else compare(systems[t.numerator][phase], systems[t.denominator][phase], t.figure)
            )
            out.append(
                {
                    "claim": t.claim,
                    "numerator": t.numerator,
                    "denominator": t.denominator,
                    "figure": t.figure,
                    "kind": kind,
                    "phase": phase,
                    "threshold": t.threshold,
                    "clocks": f"{CLOCKS[t.numerator]}/{CLOCKS[t.denominator]}",
                    "value": value,
                    "met": None if value is None else value >= t.threshold,
                }
            )
    return out


def poisson_rate(systems: dict[str, dict[str, dict]], base: str, fraction: float) -> float:
    """The Poisson phase's offered req/s: `fraction` x `base`'s all-at-once req/s (its capacity)."""
    capacity = figure(systems.get(base, {}).get(ALL_AT_ONCE, {}), "requests_per_s")
    if capacity is None:
        raise ValueError(f"rate base {base!r}: no all-at-once req/s measured")
    return round(fraction * capacity, 4)


def load_fractions(systems: dict[str, dict[str, dict]], rate_rps: float) -> dict[str, float]:
    """How hard the Poisson rate pushed each system: rate / its all-at-once req/s (near 1 = saturated)."""
    out = {}
    for name, by_phase in systems.items():
        capacity = figure(by_phase.get(ALL_AT_ONCE, {}), "requests_per_s")
        if capacity:
            out[name] = round(rate_rps / capacity, 3)
    return out


def phase_rate(phase: str) -> float:
    """The nominal offered req/s in a Poisson phase's name ('poisson-1.25rps' -> 1.25)."""
    if phase_kind(phase) != POISSON or not phase.endswith("rps"):
        raise ValueError(f"phase {phase!r}: not a 'poisson-<rate>rps' phase")
    return float(phase[len("poisson-") : -len("rps")])


def poisson_loads(systems: dict[str, dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Poisson phase -> load_fractions at its nominal rate."""
    phases = sorted({p for by_phase in systems.values() for p in by_phase if phase_kind(p) == POISSON})
    return {phase: load_fractions(systems, phase_rate(phase)) for phase in phases}

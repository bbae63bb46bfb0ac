"""Turn measured phases into figures: the JSON report, the markdown summary, the plots.

`summarize` is pure arithmetic on `PhaseResult`s (no I/O), so the numbers in bench.json, in
summary.md and in the plots all come from one place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ferry.bench.http_client import CallResult
from ferry.bench.online import PhaseResult
from ferry.bench.workload import latency_summary


def summarize(phase: PhaseResult) -> dict:
    """The headline figures of one phase (times in ms, rates per second of phase wall time)."""
    ok = [r for r in phase.results if r.ok]
    duration = phase.duration_s
    num_out = sum(r.num_output_tokens for r in ok)
    num_in = sum(r.num_prompt_tokens or 0 for r in ok)
    batch = [v for _, v in phase.batch_samples]
    return {
        "name": phase.name,
        "offered_rps": None if math.isinf(phase.rate_rps) else phase.rate_rps,
        "all_at_once": math.isinf(phase.rate_rps),
        "num_requests": len(phase.results),
        "num_ok": len(ok),
        "num_errors": len(phase.results) - len(ok),
        "num_ok_without_streamed_text": sum(1 for r in ok if not r.chunk_times_s),
        "errors": sorted({r.error for r in phase.results if r.error})[:5],
        "timed_out": phase.timed_out,
        "duration_s": phase.duration_s,
        "output_tokens": num_out,
        "prompt_tokens": num_in,
        "output_tokens_per_s": num_out / duration if duration > 0 else None,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "ttft_ms": latency_summary([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_summary([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": latency_summary([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": latency_summary([r.e2e_s for r in ok if r.e2e_s is not None]),
        "mean_batch_size": float(np.mean(batch)) if batch else None,
    }


def request_rows(results: list[CallResult]) -> list[dict]:
    """Per-request raw data for bench.json (enough to redraw every plot)."""
    return [
        {
            "index": r.index,
            "ok": r.ok,
            "error": r.error,
            "sent_at_s": _round(r.sent_at_s),
            "ttft_s": _round(r.ttft_s),
            "e2e_s": _round(r.e2e_s),
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": r.num_output_tokens,
            "finish_reason": r.finish_reason,
            "chunk_times_s": [_round(t) for t in r.chunk_times_s],
        }
        for r in results
    ]


def _round(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return round(value, 6)


def build_report(meta: dict, phases: list[PhaseResult]) -> dict:
    """The whole bench.json document."""
    return {
        "meta": meta,
        "summary": [summarize(p) for p in phases],
        "phases": [
            {
                "name": p.name,
                "offered_rps": None if math.isinf(p.rate_rps) else p.rate_rps,
                "scheduled_s": [_round(t) for t in p.scheduled_s],
                "batch_samples": [[_round(t), v] for t, v in p.batch_samples],
                "requests": request_rows(p.results),
            }
            for p in phases
        ],
    }


def fmt(value: float | None, digits: int = 1) -> str:
    """A figure for a markdown table: `digits` decimals, "–" when missing (None or NaN)."""
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_summary(report: dict, plot_names: list[str]) -> str:
    """A short human summary: one table row per phase, then the plots."""
    meta = report["meta"]
    lines = [
        f"# ferry bench — {meta.get('target', '?')}",
        "",
        f"model `{meta.get('model')}`, {meta.get('num_requests')} requests per phase, seed {meta.get('seed')}, "
        f"workload `{meta.get('workload')}`, max concurrency {meta.get('max_concurrency')}.",
        "",
        "| phase | offered req/s | ok/total | out tok/s | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
        "| ITL p99 | E2E p99 | mean batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["summary"]:
        offered = "all at once" if s["all_at_once"] else fmt(s["offered_rps"], 2)
        lines.append(
            f"| {s['name']} | {offered} | {s['num_ok']}/{s['num_requests']} | {fmt(s['output_tokens_per_s'])} "
            f"| {fmt(s['requests_per_s'], 2)} | {fmt(s['ttft_ms']['p50'])} | {fmt(s['ttft_ms']['p99'])} "
            f"| {fmt(s['tpot_ms']['p50'])} | {fmt(s['tpot_ms']['p99'])} | {fmt(s['itl_ms']['p99'])} "
            f"| {fmt(s['e2e_ms']['p99'])} | {fmt(s['mean_batch_size'])} |"
        )
    lines += [
        "",
        "Latencies in ms. TPOT = (last token - first token) / (tokens - 1) per request; "
        "ITL = gaps between streamed chunks.",
        "",
    ]
    silent = [
        f"{s['name']}: {s['num_ok_without_streamed_text']}"
        for s in report["summary"]
        if s["num_ok_without_streamed_text"]
    ]
    if silent:
        lines += [
            "Requests that finished (usage counts their tokens) but streamed no text, so have no "
            "TTFT/TPOT: " + ", ".join(silent),
            "",
        ]
    errors = [(s["name"], e) for s in report["summary"] for e in s["errors"]]
    if errors:
        lines += ["Errors (first distinct ones):"] + [f"- {name}: {err}" for name, err in errors] + [""]
    lines += [f"![{name}]({name})" for name in plot_names]
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, meta: dict, phases: list[PhaseResult], plots: bool = True) -> dict:
    """Write bench.json, the PNG plots (unless `plots` is False: a report nested in a bigger one, which
    draws its own) and summary.md into `out_dir`; returns the report dict."""
    from ferry.bench.plots import write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(meta, phases)
    (out / "bench.json").write_text(json.dumps(report, indent=1, allow_nan=False, default=_json_default))
    plot_names = write_plots(out, report) if plots else []
    (out / "summary.md").write_text(markdown_summary(report, plot_names))
    return report


def _json_default(value: object) -> object:
    raise TypeError(f"not JSON-serialisable in the bench report: {value!r}")

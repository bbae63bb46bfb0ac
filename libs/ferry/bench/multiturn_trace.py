"""Where a multi-turn request's time to first token goes (`ferry bench --multi-turn --trace-hops`).

With FERRY_TRACE_FILE set, every service stamps its hops (`ferry.bus.trace`); this joins them to the
bench's turns by request id and splits each turn's TTFT along the first token's path: client send ->
gateway -> prefill-balancer -> the prefill worker's pull, prefetch settle, prefix fetch -> its engine
steps -> the token published -> gateway -> SSE -> client. The engine's steps carry no request id: a
request's steps are those of its prefill worker's process from the first one to start after its
admission (`pw.prefix`) to the last one to end before its token was published.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ferry.bench.multiturn import TurnResult

SEGMENTS = [
    ("client.send", "gw.http", "client -> gateway (HTTP, ASGI)"),
    ("gw.http", "gw.submit", "gateway: validate, tokenize, submit"),
    ("gw.submit", "pb.submit", "-> prefill-balancer"),
    ("pb.submit", "pb.routed", "routing, JetStream publish"),
    ("pb.routed", "pw.pulled", "JetStream -> prefill worker's pull"),
    ("pw.pulled", "pw.settled", "prefetch settle (waits for a running fetch of its blocks)"),
    ("pw.settled", "pw.prefix", "prefix fetch from the store"),
    ("pw.prefix", "pw.first_step", "wait for the engine thread (a step in flight)"),
    ("pw.first_step", "pw.step_start", "earlier steps it waited through or was chunked over"),
    ("pw.step_start", "pw.step_end", "the step that made its first token"),
    ("pw.step_end", "pw.published", "token event published"),
    ("pw.published", "gw.event", "-> gateway"),
    ("gw.event", "gw.sse", "gateway: SSE write"),
    ("gw.sse", "client.first", "-> client"),
]


def read_hops(path: Path) -> list[dict]:
    """The trace file's lines (JSON), in file order; a missing file is an empty trace."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def request_hops(lines: list[dict], results: list[TurnResult]) -> list[dict]:
    """Per turn with a request id and a TTFT: its hop times (unix s), turn, and its first-token step's size."""
    by_rid: dict[str, dict] = {}
    steps: dict[int, list[dict]] = {}
    for line in lines:
        if line["rid"] == "*":
            steps.setdefault(line["pid"], []).append(line)
        else:
            hops = by_rid.setdefault(line["rid"], {})
            hops.setdefault(line["hop"], line["t"])
            if line["hop"] == "pw.pulled":
                hops.setdefault("pid", line["pid"])
    out = []
    for r in results:
        found = by_rid.get(r.request_id or "")
        if found is None or r.ttft_s is None:
            continue
        row = {**found, "turn": r.turn, "client.send": r.sent_at, "client.first": r.sent_at + r.ttft_s}
        row.update(_first_token_step(steps.get(found.get("pid", -1), []), found))
        out.append(row)
    return out


def _first_token_step(steps: list[dict], hops: dict) -> dict:
    admitted, published = hops.get("pw.prefix"), hops.get("pw.published")
    if admitted is None or published is None:
        return {}
    starts = [s for s in steps if s["hop"] == "pw.step_start" and s["t"] >= admitted]
    ends = [s for s in steps if s["hop"] == "pw.step_end" and admitted <= s["t"] <= published]
    if not starts or not ends:
        return {}
    end = ends[-1]
    start = max((s for s in starts if s["t"] <= end["t"]), key=lambda s: s["t"], default=starts[0])
    return {
        "pw.first_step": starts[0]["t"],
        "pw.step_start": start["t"],
        "pw.step_end": end["t"],
        "step_prefill_tokens": end.get("prefill_tokens", 0),
        "step_seqs": end.get("seqs", 0),
        "num_steps": sum(1 for s in ends if s["t"] >= starts[0]["t"]),
    }


def breakdown(rows: list[dict]) -> dict:
    """TTFT p50/mean and, per segment, the p50 and mean gap (ms) over `rows`; the means add up to the mean TTFT."""
    if not rows:
        return {"num_requests": 0}
    out: dict = {"num_requests": len(rows), "segments": {}}
    for begin, end, _ in SEGMENTS:
        gaps = [(r[end] - r[begin]) * 1000 for r in rows if r.get(begin) and r.get(end)]
        if gaps:
            out["segments"][f"{begin}>{end}"] = {"p50": statistics.median(gaps), "mean": statistics.fmean(gaps)}
    ttft = [(r["client.first"] - r["client.send"]) * 1000 for r in rows]
    out["ttft_ms"] = {"p50": statistics.median(ttft), "mean": statistics.fmean(ttft)}
    for key in ("step_prefill_tokens", "step_seqs", "num_steps"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[f"{key}_p50"] = statistics.median(values)
    return out


def turn_breakdowns(trace_file: Path, turns: list[TurnResult], after: list[TurnResult]) -> dict:
    """{'1': ..., '>=2': ..., 'after restart': ...} breakdowns of one mode's turns."""
    rows = request_hops(read_hops(trace_file), turns)
    return {
        "1": breakdown([r for r in rows if r["turn"] == 1]),
        ">=2": breakdown([r for r in rows if r["turn"] >= 2]),
        "after restart": breakdown(request_hops(read_hops(trace_file), after)),
    }


def markdown(modes: dict) -> list[str]:
    """A table per turn group: segment, then p50 / mean gap per mode (ms)."""
    names = [m for m in modes if "hops" in modes[m]]
    if not names:
        return []
    lines = ["", "Where TTFT goes (`--trace-hops`: hop timestamps joined by request id; gaps in ms, p50 / mean):"]
    for group in ("1", ">=2", "after restart"):
        lines += ["", f"Turn {group}:", "", "| segment | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for begin, end, label in SEGMENTS:
            cells = [_cell(modes[m]["hops"][group], f"{begin}>{end}") for m in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        cells = [_cell(modes[m]["hops"][group], "ttft") for m in names]
        lines.append("| **TTFT** | " + " | ".join(cells) + " |")
        steps = [str(modes[m]["hops"][group].get("step_prefill_tokens_p50", "-")) for m in names]
        lines.append("| first-token step's prefill tokens (p50) | " + " | ".join(steps) + " |")
    return lines


def _cell(group: dict, key: str) -> str:
    stats = group.get("ttft_ms") if key == "ttft" else group.get("segments", {}).get(key)
    return f"{stats['p50']:.1f} / {stats['mean']:.1f}" if stats else "-"

"""The first token's hop timeline of a burst through `ferry up`, from a FERRY_TRACE_FILE (`ferry.bus.trace`).

For each of the last `--num-requests` requests (the burst; ab.py's warm-up ones come before it) the time
of its first stamp at each hop (gateway receive `gw.http`, tokenized and
published `gw.submit`, balancer `pb.submit`/`pb.routed`, worker pull `bw.pulled` / `pw.pulled`, KV
settled `pw.prefix`, first token published `bw.published`, gateway event `gw.event`, first SSE chunk
`gw.sse`), in seconds from the burst's first `gw.http`; prints p10/p50/p90 per hop over the requests,
and the worker's engine steps (count, durations, requests pulled by each step's start).
Run ab.py with `FERRY_TRACE_FILE=PATH` in a variant's environment, one burst per file:

    python ops/bench/throughput/burst_hops.py /tmp/trace-base.jsonl /tmp/trace-ahead.jsonl --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HOPS = ["gw.http", "gw.submit", "pb.submit", "pb.routed", "w.pulled", "pw.prefix", "w.published", "gw.event", "gw.sse"]


def _hop_name(name: str) -> str:
    """The worker's hops under one name whichever role stamped them (`bw.pulled`, `pw.pulled` -> `w.pulled`)."""
    if name in ("bw.pulled", "pw.pulled"):
        return "w.pulled"
    if name in ("bw.published", "pw.published"):
        return "w.published"
    return name


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timeline(path: Path, num_requests: int) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first: dict[str, dict[str, float]] = {}
    steps: list[tuple[float, float]] = []
    start_t: float | None = None
    for rec in sorted(lines, key=lambda r: r["t"]):
        name = rec["hop"]
        if rec["rid"] == "*":
            if name.endswith("w.step_start"):
                start_t = rec["t"]
            elif name.endswith("w.step_end") and start_t is not None:
                steps.append((start_t, rec["t"]))
                start_t = None
            continue
        first.setdefault(rec["rid"], {}).setdefault(_hop_name(name), rec["t"])
    stamped = sorted((hops for hops in first.values() if "gw.http" in hops), key=lambda hops: hops["gw.http"])
    if not stamped:
        raise SystemExit(f"{path}: no request with a gw.http stamp (was FERRY_TRACE_FILE set for `ferry up`?)")
    requests = dict(enumerate(stamped[-num_requests:]))
    t0 = min(hops["gw.http"] for hops in requests.values())
    table = {}
    for hop in HOPS:
        values = [hops[hop] - t0 for hops in requests.values() if hop in hops]
        if values:
            table[hop] = {
                "n": len(values),
                "p10": _quantile(values, 0.1),
                "p50": statistics.median(values),
                "p90": _quantile(values, 0.9),
            }
    pulled = sorted(hops["w.pulled"] for hops in requests.values() if "w.pulled" in hops)
    burst_steps = [(s - t0, e - s) for s, e in steps if s >= t0]
    first_steps = [
        {"start_s": round(s, 4), "ms": round(d * 1000, 1), "pulled_by_start": sum(p - t0 <= s for p in pulled)}
        for s, d in burst_steps[:12]
    ]
    return {"requests": len(requests), "hops_s": table, "first_steps": first_steps, "num_steps": len(burst_steps)}


def render(name: str, fig: dict) -> str:
    out = [f"{name}: {fig['requests']} requests, {fig['num_steps']} steps; seconds from the burst's first gw.http"]
    out.append(f"  {'hop':12s} {'p10':>7s} {'p50':>7s} {'p90':>7s}")
    for hop, q in fig["hops_s"].items():
        out.append(f"  {hop:12s} {q['p10']:7.3f} {q['p50']:7.3f} {q['p90']:7.3f}")
    out.append("  first steps (start s, ms, requests pulled by then): ")
    out.append("  " + " ".join(f"{s['start_s']:.2f}/{s['ms']:.0f}/{s['pulled_by_start']}" for s in fig["first_steps"]))
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path, help="FERRY_TRACE_FILE of one burst each")
    p.add_argument("--num-requests", type=int, default=48, help="the burst's size (the last ones stamped)")
    p.add_argument("--json", type=Path, help="write the timelines here")
    p.add_argument("--plot", type=Path, help="draw p10/p50/p90 per hop, one line per trace, into this PNG")
    args = p.parse_args()
    figs = {path.stem: timeline(path, args.num_requests) for path in args.traces}
    for name, fig in figs.items():
        print(render(name, fig))
    if args.json:
        args.json.write_text(json.dumps(figs, indent=1) + "\n")
    if args.plot:
        plot(figs, args.plot)
    return 0


def plot(figs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, timeline_ in figs.items():
        hops = list(timeline_["hops_s"])
        ys = range(len(hops))
        p50 = [timeline_["hops_s"][h]["p50"] for h in hops]
        low = [timeline_["hops_s"][h]["p50"] - timeline_["hops_s"][h]["p10"] for h in hops]
        high = [timeline_["hops_s"][h]["p90"] - timeline_["hops_s"][h]["p50"] for h in hops]
        ax.errorbar(p50, ys, xerr=[low, high], fmt="o-", capsize=3, label=name)
        ax.set_yticks(list(ys), hops)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the burst's first gw.http (p50, bars p10-p90)")
    ax.set_title("first token's hops through `ferry up`, SmolLM2 48-request burst")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

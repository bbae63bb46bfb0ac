"""A/B of `ferry up` variants on the burst, alternating, several bursts per server start.

Each variant is a name, environment variables and `ferry up` options; every round starts each variant
once (the order reversed every other round) and sends it the same bursts (seeds 1..K: a fresh seed
per burst, so no burst finds another's prompts in the prefix cache), then stops it. Prints output
tok/s per variant and burst, and the mean per variant; the same burst seed is comparable across variants.
--rate R sends each burst's requests at Poisson arrivals of R requests/s instead of all at once.
This box's run-to-run spread is large (one call to the next): compare only within one call.

    /work/tools/cpu-bench python ops/bench/throughput/ab.py --model DIR --rounds 2 --bursts 3 \\
        --variant 'base=' --variant 'nowb=FERRY_KV_WRITEBACK=0' --variant 't1=|--torch-threads 1'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ferry.bench.compare import servers
from ferry.bench.http_client import CompletionCall
from ferry.bench.online import OnlineConfig, detect_model, ids_to_text, run_phase
from ferry.bench.throughput import burst
from ferry.bench.workload import poisson_arrivals


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """'name=K=V K2=V2|--opt x' -> (name, env, ferry up options)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=[ENV ...][|OPTIONS]")
    env_text, _, options = rest.partition("|")
    env = dict(kv.split("=", 1) for kv in env_text.split())
    return name, env, options.split()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--variant", action="append", required=True, help="NAME=[K=V ...][|ferry up options]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bursts", type=int, default=2, help="bursts per server start (seeds 1..K)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrivals, requests/s (default: all at once)")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for name, env, options in order:
            for row in run_variant(args.model, env, options, vocab, args.bursts, args.num_requests, args.rate):
                results[name].append({"round": rnd, **row})
                tok_s, ttft = row["tok_s"], row["ttft_p50_ms"]
                print(f"round {rnd} {name}: seed {row['seed']} {tok_s:.1f} tok/s, TTFT p50 {ttft:.0f} ms", flush=True)
    print("\nvariant  mean tok/s  mean TTFT p50 ms  (tok/s per burst)")
    for name, rows in results.items():
        values = [r["tok_s"] for r in rows]
        ttft = statistics.mean(r["ttft_p50_ms"] for r in rows)
        print(f"{name:12s} {statistics.mean(values):8.1f} {ttft:8.0f}  {' '.join(f'{v:.0f}' for v in values)}")
    if args.json:
        args.json.write_text(json.dumps({"variants": args.variant, "results": results}, indent=1))
    return 0


def run_variant(model: Path, env: dict[str, str], options: list[str], vocab: int, bursts: int, num_requests, rate):
    run_dir = Path(tempfile.mkdtemp(prefix="ferry-ab-"))
    port = servers.free_port()
    argv = servers.ferry_up_argv(model, port, run_dir / "ferry-up-run", *options)
    server = servers.spawn("ferry-up", argv, f"http://127.0.0.1:{port}", run_dir, env)
    rows = []
    try:
        problem = servers.wait_ready(server, 300, log_marker="ferry up: ready")
        if problem:
            raise SystemExit(problem)
        config = OnlineConfig(
            base_url=server.base_url, model=detect_model(server.base_url), length_control="none", show_progress=False
        )
        warm = [CompletionCall(i, "the ferry river boat harbor dock", 4, 7) for i in range(2)]
        asyncio.run(run_phase(warm, [0.0, 0.0], config, "warm-up", math.inf))
        for seed in range(1, bursts + 1):
            requests = burst.burst_requests(vocab, num_requests, seed)
            calls = [CompletionCall(r.index, ids_to_text(r.prompt_token_ids), r.max_tokens, 1) for r in requests]
            started = time.perf_counter()
            arrivals = poisson_arrivals(len(calls), rate, seed)
            phase = asyncio.run(run_phase(calls, arrivals, config, "burst", math.inf))
            wall = time.perf_counter() - started
            ok = [r for r in phase.results if r.ok]
            tokens = sum(r.num_output_tokens for r in ok)
            ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
            row = {"seed": seed, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}
            row["failed"] = len(calls) - len(ok)
            rows.append({**row, "ttft_p50_ms": statistics.median(ttfts) if ttfts else math.nan})
    finally:
        servers.stop(server)
    return rows


if __name__ == "__main__":
    sys.exit(main())

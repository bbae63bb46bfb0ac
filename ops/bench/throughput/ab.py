"""A/B of `ferry up` variants on the burst, alternating, several bursts per server start.

Each variant is a name, environment variables and `ferry up` options; every round starts each variant
once (the order reversed every other round) and sends it the same bursts (seeds 1..K: a fresh seed
per burst, so no burst finds another's prompts in the prefix cache), then stops it. Prints output
tok/s per variant and burst, and the mean per variant; the same burst seed is comparable across variants.
--rate R sends each burst's requests at Poisson arrivals of R requests/s instead of all at once.
--engine also runs the in-process engine (`ferry.bench.throughput.inproc`, all requests added at t=0) on
the same bursts in every round, in its own process, and prints each variant's tok/s over the engine's, per
round and overall; --flops measures the machine's dense matmul rate once and prints model FLOPs delivered
(weights + attention, as run.py counts them) as a share of it.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ferry.bench.compare import servers
from ferry.bench.http_client import CompletionCall
from ferry.bench.online import OnlineConfig, detect_model, ids_to_text, run_phase
from ferry.bench.throughput import burst
from ferry.bench.workload import poisson_arrivals
from ferry.model.config import read_config
from ferry.model.source import resolve_model


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
    p.add_argument("--model", required=True, help="checkpoint folder, .gguf file, or smollm2 (the default model)")
    p.add_argument("--variant", action="append", required=True, help="NAME=[K=V ...][|ferry up options]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bursts", type=int, default=2, help="bursts per server start (seeds 1..K)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrivals, requests/s (default: all at once)")
    p.add_argument("--engine", action="store_true", help="the in-process engine on the same bursts each round")
    p.add_argument("--flops", action="store_true", help="model FLOPs as a share of the matmul rate")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    args.model = resolve_model(args.model)
    vocab = read_config(args.model).vocab_size
    flops = _flops(args.model) if args.flops else None
    names = [name for name, _, _ in variants] + (["engine"] if args.engine else [])
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        order: list = variants + ([("engine", {}, None)] if args.engine else [])
        for name, env, options in order if rnd % 2 == 0 else order[::-1]:
            if options is None:
                rows = run_engine(args.model, vocab, args.bursts, args.num_requests)
            else:
                rows = run_variant(args.model, env, options, vocab, args.bursts, args.num_requests, args.rate)
            for row in rows:
                lengths = row.pop("lengths")
                if flops is not None:
                    if "model_gflops" not in row:  # the engine reports its own, counted the same way
                        total = flops["per_token"] * sum(p + o for p, o in lengths)
                        total += burst.attention_flops(flops["config"], lengths)
                        row["model_gflops"] = total / row["wall_s"] / 1e9
                    row["flops_share"] = row["model_gflops"] / flops["matmul_gflops"]
                results[name].append({"round": rnd, **row})
                tok_s, ttft = row["tok_s"], row["ttft_p50_ms"]
                print(f"round {rnd} {name}: seed {row['seed']} {tok_s:.1f} tok/s, TTFT p50 {ttft:.0f} ms", flush=True)
    summary = summarize(results, "engine" if args.engine else None)
    print(summary["text"])
    if args.json:
        machine = {k: v for k, v in (flops or {}).items() if k != "config"}
        doc = {"variants": args.variant, "rate": args.rate if math.isfinite(args.rate) else "burst", "flops": machine}
        args.json.write_text(json.dumps({**doc, "summary": summary["figures"], "results": results}, indent=1))
    return 0


def summarize(results: dict[str, list[dict]], engine: str | None) -> dict:
    """Mean tok/s, TTFT, FLOPs share per variant; with the engine, each variant's tok/s over the engine's
    on the same round and seed, per round (the mean of its bursts' ratios) and over all."""
    lines = ["", "variant      mean tok/s  TTFT p50 ms  FLOPs share  / engine (per round)   tok/s per burst"]
    figures = {}
    base = {(r["round"], r["seed"]): r["tok_s"] for r in results.get(engine or "", [])}
    for name, rows in results.items():
        values = [r["tok_s"] for r in rows]
        fig = {"tok_s": statistics.mean(values), "ttft_p50_ms": statistics.mean(r["ttft_p50_ms"] for r in rows)}
        if rows and "flops_share" in rows[0]:
            fig["flops_share"] = statistics.mean(r["flops_share"] for r in rows)
        ratio_text = ""
        if engine and name != engine and base:
            per_round: dict[int, list[float]] = {}
            for r in rows:
                per_round.setdefault(r["round"], []).append(r["tok_s"] / base[(r["round"], r["seed"])])
            fig["per_round_over_engine"] = [statistics.mean(v) for _, v in sorted(per_round.items())]
            fig["over_engine"] = statistics.mean(fig["per_round_over_engine"])
            ratio_text = f"{fig['over_engine']:.3f} ({' '.join(f'{v:.2f}' for v in fig['per_round_over_engine'])})"
        share = f"{fig['flops_share']:.1%}" if "flops_share" in fig else "-"
        lines.append(
            f"{name:12s} {fig['tok_s']:10.1f} {fig['ttft_p50_ms']:12.0f} {share:>12s}  {ratio_text:22s} "
            + " ".join(f"{v:.0f}" for v in values)
        )
        figures[name] = fig
    return {"text": "\n".join(lines), "figures": figures}


def _flops(model: Path) -> dict:
    from ferry.bench.offline_report import matmul_gflops, model_flops_per_token
    from ferry.model import load_model

    lm = load_model(str(model))
    return {"per_token": model_flops_per_token(lm), "matmul_gflops": matmul_gflops(seconds=2.0), "config": lm.config}


def run_engine(model: Path, vocab: int, bursts: int, num_requests) -> list[dict]:
    """The in-process engine on each burst seed, one process per burst (inproc.py: load, warm up, run)."""
    rows = []
    for seed in range(1, bursts + 1):
        requests = burst.burst_requests(vocab, num_requests, seed)
        prompts = burst.write_prompts(requests, Path(tempfile.mkdtemp(prefix="ferry-ab-engine-")) / "burst.jsonl")
        argv = [sys.executable, "-m", "ferry.bench.throughput.inproc", "--model", str(model), "--prompts", str(prompts)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"in-process engine exited with {done.returncode}: {done.stderr[-1500:]}")
        fig = json.loads(done.stdout.strip().splitlines()[-1])
        row = {
            "seed": seed,
            "wall_s": fig["wall_s"],
            "tokens": fig["output_tokens"],
            "tok_s": fig["output_tokens_per_s"],
        }
        row.update(failed=0, ttft_p50_ms=fig["ttft_ms"]["p50"], model_gflops=fig["model_gflops"], lengths=[])
        rows.append(row)
    return rows


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
            row: dict[str, Any] = {"seed": seed, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}
            row["failed"] = len(calls) - len(ok)
            row["lengths"] = [(r.num_prompt_tokens or 0, r.num_output_tokens) for r in ok]
            rows.append({**row, "ttft_p50_ms": statistics.median(ttfts) if ttfts else math.nan})
    finally:
        servers.stop(server)
    return rows


if __name__ == "__main__":
    sys.exit(main())

"""What the microservice split costs: the whole system (`ferry up`) vs the same engine in-process.

One invocation, same `bench` checkpoint, same seeded workload (shared/BENCHMARKS.md):
  1. offline throughput: every request at once; output tokens/s, first send to last token;
  2. low-load TTFT: the first `--ttft-requests` prompts one at a time (nothing else running);
     time from submit to first token. In-process that is add_request -> the step that emits it;
     through the system it is HTTP POST -> first SSE content chunk (gateway, prefill-balancer,
     JetStream, prefill worker, token event back through the gateway).
The engine runs first, then `ferry up` starts and gets the same work over HTTP. Writes
report.json and report.png into --out, and prints the two ratios the issue asks for:
system/engine output tokens/s (goal >= 0.85) and system - engine p50 TTFT (goal <= 10 ms).

    .venv/bin/python ops/bench/system/run.py --out ops/bench/system/reports/<name>
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ferry.bench.online import OnlineConfig, make_calls, run_phase
from ferry.bench.workload import WorkloadConfig, latency_summary, make_workload
from ferry.launcher.servers import free_port
from ferry.protocol import SamplingParams

ENGINE_ARGS = dict(num_kv_blocks=2048, max_num_seqs=32, max_num_batched_tokens=2048)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, help="checkpoint (default: a fresh random `bench` llama)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=16)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ---- the engine in-process -------------------------------------------------------------------
def engine_offline(engine, requests) -> dict:
    start = time.perf_counter()
    for r in requests:
        engine.add_request(f"o{r.index}", r.prompt_token_ids, _sampling(r.max_tokens))
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    duration_s = time.perf_counter() - start
    return {"duration_s": duration_s, "output_tokens": num_tokens, "output_tokens_per_s": num_tokens / duration_s}


def engine_ttft(engine, requests) -> list[float]:
    ttfts = []
    for r in requests:
        start = time.perf_counter()
        engine.add_request(f"t{r.index}", r.prompt_token_ids, _sampling(8))
        while not engine.step():
            pass
        ttfts.append(time.perf_counter() - start)
        engine.abort_request(f"t{r.index}")
    return ttfts


def _sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0, ignore_eos=True)


def run_engine(model: Path, requests, ttft_requests) -> dict:
    from ferry.engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_model_path(model, EngineConfig(**ENGINE_ARGS, enable_prefix_caching=False))
    engine_ttft(engine, ttft_requests[:2])  # warm-up
    offline = engine_offline(engine, requests)
    return {"offline": offline, "ttft_s": engine_ttft(engine, ttft_requests)}


# ---- the system over HTTP ----------------------------------------------------------------------
def start_system(model: Path, run_dir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ferry.cli", "up", "--model", str(model), "--port", str(port),
           "--prefill-workers", str(args.prefill_workers), "--decode-workers", str(args.decode_workers),
           "--num-kv-blocks", str(ENGINE_ARGS["num_kv_blocks"]), "--max-running", str(ENGINE_ARGS["max_num_seqs"]),
           "--max-batch-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]), "--run-dir", str(run_dir)]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        print("  " + line.rstrip(), flush=True)
        if "ferry up: ready" in line:
            return process, f"http://127.0.0.1:{port}"
        if "exited" in line and "ferry up:" in line:
            break
    process.kill()
    raise SystemExit("ferry up did not become ready")


async def system_phases(base_url: str, model_name: str, calls, ttft_calls) -> dict:
    config = OnlineConfig(base_url=base_url, model=model_name, max_concurrency=len(calls), show_progress=False)
    await run_phase(ttft_calls[:2], [0.0, 0.0], config, "warm-up", math.inf)
    offline = await run_phase(calls, [0.0] * len(calls), config, "offline", math.inf)
    serial = OnlineConfig(base_url=base_url, model=model_name, max_concurrency=1, show_progress=False)
    ttft = await run_phase(ttft_calls, [0.0] * len(ttft_calls), serial, "ttft", math.inf)
    errors = [r.error for r in offline.results + ttft.results if not r.ok]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed through the system, e.g. {errors[0]}")
    num_tokens = sum(r.num_output_tokens for r in offline.results)
    return {"offline": {"duration_s": offline.duration_s, "output_tokens": num_tokens,
                        "output_tokens_per_s": num_tokens / offline.duration_s},
            "ttft_s": [r.ttft_s for r in ttft.results]}


def run_system(model: Path, run_dir: Path, args, calls, ttft_calls) -> dict:
    process, base_url = start_system(model, run_dir, args)
    try:
        return asyncio.run(system_phases(base_url, model.name, calls, ttft_calls))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


# ---- report ------------------------------------------------------------------------------------
def report(args, model: Path, engine: dict, system: dict) -> dict:
    for side in (engine, system):
        side["ttft_ms"] = latency_summary(side.pop("ttft_s"))
    throughput_ratio = system["offline"]["output_tokens_per_s"] / engine["offline"]["output_tokens_per_s"]
    ttft_added_ms = system["ttft_ms"]["p50"] - engine["ttft_ms"]["p50"]
    return {
        "model": str(model), "num_requests": args.num_requests, "ttft_requests": args.ttft_requests,
        "seed": args.seed, "engine_config": ENGINE_ARGS,
        "system": {"prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers, **system},
        "engine": engine,
        "ratios": {"output_tokens_per_s_system_over_engine": throughput_ratio,
                   "p50_ttft_added_ms": ttft_added_ms,
                   "goal_throughput_ratio": 0.85, "goal_ttft_added_ms": 10.0,
                   "meets_throughput_goal": throughput_ratio >= 0.85, "meets_ttft_goal": ttft_added_ms <= 10.0},
    }


def plot(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["engine in-process", "system (ferry up)"]
    sides = [result["engine"], result["system"]]
    a.bar(names, [s["offline"]["output_tokens_per_s"] for s in sides], color=["#888", "#1f77b4"])
    a.set_title("offline output tokens/s")
    b.bar(names, [s["ttft_ms"]["p50"] for s in sides], color=["#888", "#1f77b4"])
    b.set_title("p50 TTFT at low load (ms)")
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=110)


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-bench-system-"))
    model = args.model
    if model is None:
        from ferry.model.make_model import make_model

        model = make_model(tmp / "bench", "llama", "bench")
    workload = WorkloadConfig(num_requests=args.num_requests, seed=args.seed)
    requests = make_workload(workload)
    ttft_requests = requests[: args.ttft_requests]
    calls = make_calls(workload, "ids")
    ttft_calls = [dataclasses.replace(c, max_tokens=8) for c in calls[: args.ttft_requests]]
    print(f"engine in-process: {args.num_requests} requests", flush=True)
    engine = run_engine(model, requests, ttft_requests)
    print(f"system: ferry up with {args.prefill_workers} prefill + {args.decode_workers} decode workers", flush=True)
    system = run_system(model, tmp / "run", args, calls, ttft_calls)
    result = report(args, model, engine, system)
    (args.out / "report.json").write_text(json.dumps(result, indent=2))
    plot(args.out, result)
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

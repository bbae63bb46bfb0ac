"""What the microservice split costs: the whole system (`ferry up`) vs the same engine in-process.

One invocation, same `bench` checkpoint, same seeded workload (shared/BENCHMARKS.md):
  1. offline throughput: every request at once; output tokens/s, first send to last token;
  2. low-load TTFT: the first `--ttft-requests` prompts one at a time (nothing else running),
     engine and system alternating request by request; time from submit to first token.
     In-process that is add_request -> the step that emits it; through the system it is HTTP POST
     -> first SSE content chunk (gateway, prefill-balancer, JetStream, prefill worker, token event
     back through the gateway), timed twice: by the bench's httpx client (the goal's figure, what
     an SDK user sees) and at a bare socket (socket_client.py: without the client's own 2-3 ms).
`ferry up` starts once; then for each of --rounds rounds the engine and the system take turns on
that round's workload (a new seed per round, so no prefix cache carries over), so load from other
processes on a shared machine hits both alike. The system idles while the engine runs. Writes
report.json and report.png into --out and prints the two ratios the issue asks for, from the
medians over rounds: system/engine output tokens/s (goal >= 0.85) and system - engine p50 TTFT
(goal <= 10 ms), plus the TTFT added as the median of per-prompt differences and at the socket,
and the 1-minute load average at start and end.

    .venv/bin/python ops/bench/system/run.py --out ops/bench/system/reports/<name>
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ferry.bench.http_client import build_body, stream_completion
from ferry.bench.online import OnlineConfig, make_calls, run_phase
from ferry.bench.system.socket_client import SocketClient
from ferry.bench.workload import WorkloadConfig, latency_summary, make_workload
from ferry.launcher.servers import free_port
from ferry.protocol import SamplingParams

ENGINE_ARGS: dict[str, Any] = dict(num_kv_blocks=2048, max_num_seqs=32, max_num_batched_tokens=2048)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, help="checkpoint (default: a fresh random `bench` llama)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=16)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-threads", type=int, help="CPU threads per worker process (ferry up --torch-threads)")
    p.add_argument(
        "--engine-threads",
        type=int,
        help="torch threads of the in-process engine (default: the workers' total, when --torch-threads)",
    )
    args = p.parse_args()
    if args.ttft_requests > args.num_requests:
        p.error(
            f"--ttft-requests {args.ttft_requests}: at most --num-requests ({args.num_requests}); "
            "the TTFT prompts are the workload's first ones"
        )
    return args


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


def make_engine(model: Path, threads: int | None):
    import torch

    from ferry.engine import EngineConfig, LLMEngine

    if threads:
        torch.set_num_threads(threads)

    engine = LLMEngine.from_model_path(model, EngineConfig(**ENGINE_ARGS))
    engine_ttft(engine, make_workload(WorkloadConfig(num_requests=2, seed=10**6)))  # warm-up
    return engine


# ---- the system over HTTP ----------------------------------------------------------------------
def system_command(model: Path, port: int, run_dir: Path, args: argparse.Namespace) -> list[str]:
    """`ferry up` with ENGINE_ARGS (the in-process engine's settings), args' threads and, where given (not
    None), worker counts: without them `ferry up` picks its own layout (one both-roles worker on a small
    machine), the one users get; args.up_args, when set: more `ferry up` options."""
    cmd = [sys.executable, "-m", "ferry.cli", "up", "--model", str(model), "--port", str(port)]
    for flag, value in (("--prefill-workers", args.prefill_workers), ("--decode-workers", args.decode_workers)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += ["--num-kv-blocks", str(ENGINE_ARGS["num_kv_blocks"]), "--max-running", str(ENGINE_ARGS["max_num_seqs"])]
    cmd += ["--max-batch-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]), "--run-dir", str(run_dir)]
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    return cmd + list(getattr(args, "up_args", None) or [])  # trace.py's --layout


def start_system(
    model: Path, run_dir: Path, args: argparse.Namespace, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`ferry up` as `system_command` builds it, on a free port; env: its environment (default: this
    process's)."""
    port = free_port()
    cmd = system_command(model, port, run_dir, args)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None  # stdout=PIPE
    for line in process.stdout:
        print("  " + line.rstrip(), flush=True)
        if "ferry up: ready" in line:
            return process, f"http://127.0.0.1:{port}"
        if "exited" in line and "ferry up:" in line:
            break
    process.kill()
    raise SystemExit("ferry up did not become ready")


async def system_offline(base_url: str, model_name: str, calls) -> dict:
    config = OnlineConfig(base_url=base_url, model=model_name, max_concurrency=len(calls), show_progress=False)
    offline = await run_phase(calls, [0.0] * len(calls), config, "offline", math.inf)
    errors = [r.error for r in offline.results if not r.ok]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed through the system, e.g. {errors[0]}")
    num_tokens = sum(r.num_output_tokens for r in offline.results)
    return {
        "duration_s": offline.duration_s,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / offline.duration_s,
    }


async def ttft_pairs(
    engine, base_url: str, model_name: str, requests, calls
) -> tuple[list[float], list[float], list[float]]:
    """Low-load TTFT, request by request on the same prompt: the engine, then the system through the
    bench's httpx client and through a bare socket (these two in turns, neither always right after
    the engine), so that load from other processes hits every side alike."""
    engine_s, system_s, socket_s = [], [], []
    raw = SocketClient(base_url)
    async with httpx.AsyncClient() as client:
        for i, (request, call) in enumerate(zip(requests, calls)):
            engine_s += engine_ttft(engine, [request])
            body = build_body(call, model_name, "extra")
            for side in ("httpx", "socket") if i % 2 == 0 else ("socket", "httpx"):
                if side == "socket":
                    socket_s.append(await raw.ttft_s("/v1/completions", body))
                    continue
                result = await stream_completion(client, f"{base_url}/v1/completions", body, call, 0.0, 120.0)
                if not result.ok:
                    raise SystemExit(f"a TTFT request failed through the system: {result.error}")
                assert result.ttft_s is not None  # ok and streamed text
                system_s.append(result.ttft_s)
    await raw.close()
    return engine_s, system_s, socket_s


def warm_up_system(base_url: str, model_name: str) -> None:
    calls = make_calls(WorkloadConfig(num_requests=2, seed=10**6), "ids")
    config = OnlineConfig(base_url=base_url, model=model_name, max_concurrency=2, show_progress=False)
    asyncio.run(run_phase(calls, [0.0, 0.0], config, "warm-up", math.inf))


# ---- report ------------------------------------------------------------------------------------
def round_ratios(engine: dict, system: dict) -> dict:
    """The goal's figure is the difference of the p50s; the median of the per-prompt differences
    (same prompt, back to back) is given beside it, as it is less sensitive to which prompts land
    in the middle on a noisy machine."""
    pairs_ms = [(s - e) * 1000 for e, s in zip(engine["ttft_s"], system["ttft_s"])]
    socket_ms = [round(t * 1000, 2) for t in system.pop("ttft_socket_s")]
    for side in (engine, system):
        side["ttft_each_ms"] = [round(t * 1000, 2) for t in side["ttft_s"]]
        side["ttft_ms"] = latency_summary(side.pop("ttft_s"))
    system["ttft_socket_each_ms"] = socket_ms
    system["ttft_socket_ms"] = latency_summary([t / 1000 for t in socket_ms])
    return {
        "throughput_ratio": system["offline"]["output_tokens_per_s"] / engine["offline"]["output_tokens_per_s"],
        "ttft_added_ms": system["ttft_ms"]["p50"] - engine["ttft_ms"]["p50"],
        "ttft_added_median_of_pairs_ms": statistics.median(pairs_ms),
        "ttft_added_socket_ms": system["ttft_socket_ms"]["p50"] - engine["ttft_ms"]["p50"],
    }


def report(args, model: Path, rounds: list[dict]) -> dict:
    throughput_ratio = statistics.median(r["ratios"]["throughput_ratio"] for r in rounds)
    ttft_added_ms = statistics.median(r["ratios"]["ttft_added_ms"] for r in rounds)
    paired_ms = statistics.median(r["ratios"]["ttft_added_median_of_pairs_ms"] for r in rounds)
    socket_ms = statistics.median(r["ratios"]["ttft_added_socket_ms"] for r in rounds)
    return {
        "model": str(model),
        "num_requests": args.num_requests,
        "ttft_requests": args.ttft_requests,
        "seed": args.seed,
        "engine_config": ENGINE_ARGS,
        "system_workers": {
            "prefill": args.prefill_workers,
            "decode": args.decode_workers,
            "torch_threads": args.torch_threads or "default",
        },
        "engine_threads": args.engine_threads or "default",
        "load_average": {"start": args.load_at_start, "end": os.getloadavg()[0]},
        "rounds": rounds,
        "ratios": {
            "output_tokens_per_s_system_over_engine": throughput_ratio,
            "p50_ttft_added_ms": ttft_added_ms,
            "ttft_added_median_of_pairs_ms": paired_ms,
            "p50_ttft_added_socket_client_ms": socket_ms,
            "goal_throughput_ratio": 0.85,
            "goal_ttft_added_ms": 10.0,
            "meets_throughput_goal": throughput_ratio >= 0.85,
            "meets_ttft_goal": ttft_added_ms <= 10.0,
        },
    }


def plot(out: Path, result: dict) -> None:
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    rounds = result["rounds"]
    xs = range(len(rounds))
    for offset, side, color in ((-0.2, "engine", "#888"), (0.2, "system", "#1f77b4")):
        label = "engine in-process" if side == "engine" else "system (ferry up)"
        a.bar(
            [x + offset for x in xs],
            [r[side]["offline"]["output_tokens_per_s"] for r in rounds],
            0.4,
            color=color,
            label=label,
        )
        b.bar([x + offset for x in xs], [r[side]["ttft_ms"]["p50"] for r in rounds], 0.4, color=color, label=label)
    a.set_title("offline output tokens/s, per round")
    b.set_title("p50 TTFT at low load (ms), per round")
    for ax in (a, b):
        ax.set_xticks(list(xs), [f"round {i}" for i in xs])
        ax.legend(fontsize=8)
    save_figure(fig, out / "report.png")


def one_round(engine, base_url: str, model_name: str, args, seed: int) -> dict:
    """This round's workload: offline on the engine, then on the system; then TTFT pairs."""
    workload = WorkloadConfig(num_requests=args.num_requests, seed=seed)
    requests = make_workload(workload)
    calls = make_calls(workload, "ids")
    ttft_calls = [dataclasses.replace(c, max_tokens=8) for c in calls[: args.ttft_requests]]
    engine_side: dict[str, Any] = {"offline": engine_offline(engine, requests)}
    system_side: dict[str, Any] = {"offline": asyncio.run(system_offline(base_url, model_name, calls))}
    engine_side["ttft_s"], system_side["ttft_s"], system_side["ttft_socket_s"] = asyncio.run(
        ttft_pairs(engine, base_url, model_name, requests[: args.ttft_requests], ttft_calls)
    )
    return {
        "seed": seed,
        "engine": engine_side,
        "system": system_side,
        "ratios": round_ratios(engine_side, system_side),
    }


def main() -> int:
    args = parse_args()
    args.load_at_start = os.getloadavg()[0]  # 1-minute load average: how shared the machine was
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-bench-system-"))
    model = args.model
    if model is None:
        from ferry.model.make_model import make_model

        model = make_model(tmp / "bench", "llama", "bench")
    if args.engine_threads is None and args.torch_threads:
        args.engine_threads = args.torch_threads * (args.prefill_workers + args.decode_workers)
    engine = make_engine(model, args.engine_threads)
    print(f"system: ferry up with {args.prefill_workers} prefill + {args.decode_workers} decode workers", flush=True)
    process, base_url = start_system(model, tmp / "run", args)
    rounds = []
    try:
        warm_up_system(base_url, model.name)
        for i in range(args.rounds):
            rounds.append(one_round(engine, base_url, model.name, args, args.seed + i))
            print(f"round {i}: {json.dumps(rounds[-1]['ratios'])}", flush=True)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    result = report(args, model, rounds)
    (args.out / "report.json").write_text(json.dumps(result, indent=2))
    plot(args.out, result)
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

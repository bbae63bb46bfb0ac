"""Where one request's time to first token goes, hop by hop, through `ferry up`.

Starts the system with FERRY_TRACE_FILE set (every service appends hop timestamps, see
`ferry.bus.trace`), sends `--requests` streaming completions one at a time (nothing else running)
and prints, per hop of the first token's critical path, the median gap from the previous hop; the
client's send, socket write and first chunk bracket it all. With `--engine` each prompt first runs
on the engine in-process, as in run.py, to compare. A diagnostic, not a benchmark: run.py measures.
`--layout auto` (the default) lets `ferry up` pick its layout, as a user gets it (one both-roles worker on
<= 4 cores); the worker's hops read the same in either layout (`w.*`: the prefill worker's or the
both-roles worker's). Requests name the model as the gateway lists it at /v1/models.

    .venv/bin/python ops/bench/system/trace.py --model smollm2 --requests 24 --engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ferry.bench.http_client import build_body, stream_completion
from ferry.bench.online import detect_model, make_calls
from ferry.bench.system.run import engine_ttft, make_engine, start_system
from ferry.bench.workload import WorkloadConfig, make_workload
from ferry.model.config import read_config
from ferry.model.source import resolve_model

HOPS = [
    "client.send",
    "client.write",
    "gw.asgi",
    "gw.http",
    "gw.submit",
    "pb.submit",
    "pb.routed",
    "w.pulled",
    "w.prefix",
    "w.step_start",
    "w.step_end",
    "w.published",
    "gw.event",
    "gw.sse",
    "client.first",
]


def stamp_socket_writes() -> list[float]:
    """Wall times of the client's socket writes (httpcore's anyio stream): where the client's own
    cost ends and the gateway's begins."""
    import httpcore._backends.anyio as backend

    writes: list[float] = []
    original = backend.AnyIOStream.write

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        writes.append(time.time())
        await original(self, buffer, timeout)

    backend.AnyIOStream.write = write  # type: ignore[method-assign]  # timestamps every socket write
    return writes


WRITES = stamp_socket_writes()


async def send_all(
    base_url: str, model_name: str, vocab_size: int, num_requests: int, seed: int, engine=None
) -> list[dict]:
    """One request at a time; with `engine`, the same prompt in-process first (as run.py pairs them)."""
    workload = WorkloadConfig(num_requests=num_requests, seed=seed, vocab_size=vocab_size)
    calls = make_calls(workload, "ids")
    stamps = []
    async with httpx.AsyncClient() as client:
        for call, request in zip(calls, make_workload(workload)):
            call.max_tokens = 2
            engine_ttft_s = engine_ttft(engine, [request])[0] if engine is not None else None
            sent = time.time()
            WRITES.clear()
            result = await stream_completion(
                client, f"{base_url}/v1/completions", build_body(call, model_name, "extra"), call, 0.0, 60.0
            )
            if not result.ok:
                raise SystemExit(f"request failed: {result.error}")
            assert result.ttft_s is not None  # ok: text streamed
            stamps.append(
                {
                    "client.send": sent,
                    "client.write": WRITES[0],
                    "client.first": sent + result.ttft_s,
                    "engine_ttft_s": engine_ttft_s,
                }
            )
    return stamps


def worker_hop(name: str) -> str:
    """'pw.x' (prefill worker) and 'bw.x' (both-roles worker) -> 'w.x': the worker that makes the first
    token, whichever layout runs; other hops (the decode worker's 'dw.x' among them) as they are."""
    role, dot, rest = name.partition(".")
    return f"w.{rest}" if dot and role in ("pw", "bw") else name


def per_request(lines: list[dict], stamps: list[dict]) -> list[dict]:
    """Each request's hop times, in the order sent; its step is the first one after 'w.prefix'."""
    by_rid: dict[str, dict] = {}
    steps = []
    for line in lines:
        line = {**line, "hop": worker_hop(line["hop"])}
        if line["rid"] == "*":
            steps.append(line)
        else:
            by_rid.setdefault(line["rid"], {}).setdefault(line["hop"], line["t"])
    gateway_order = sorted((r for r in by_rid.values() if "gw.http" in r), key=lambda r: r["gw.http"])
    out = []
    for hops, client in zip(gateway_order, stamps):
        hops.update(client)
        # steps are stamped on the engine thread, with no request id: the first one after the pull
        prefix = hops.get("w.prefix", 0)
        start = next((s["t"] for s in steps if s["hop"] == "w.step_start" and s["t"] >= prefix), None)
        end = next((s["t"] for s in steps if s["hop"] == "w.step_end" and start and s["t"] >= start), None)
        hops["w.step_start"], hops["w.step_end"] = start, end
        for name in ("gw.asgi",):
            hops[name] = next((s["t"] for s in steps if s["hop"] == name and s["t"] >= client["client.send"]), None)
        out.append(hops)
    return out


def summarize(requests: list[dict]) -> None:
    print(f"{'hop':<16}{'median gap from previous (ms)':>32}{'p90':>10}")
    for prev, hop in zip(HOPS, HOPS[1:]):
        gaps = [(r[hop] - r[prev]) * 1000 for r in requests if r.get(hop) and r.get(prev)]
        if gaps:
            gaps.sort()
            print(f"{hop:<16}{statistics.median(gaps):>32.2f}{gaps[int(0.9 * (len(gaps) - 1))]:>10.2f}")
    total = [(r["client.first"] - r["client.send"]) * 1000 for r in requests]
    step = [(r["w.step_end"] - r["w.step_start"]) * 1000 for r in requests if r.get("w.step_end")]
    print(
        f"client TTFT median {statistics.median(total):.2f} ms; worker step median {statistics.median(step):.2f} ms; "
        f"outside the step {statistics.median(t - s for t, s in zip(total, step)):.2f} ms"
    )
    if requests[0].get("engine_ttft_s") is not None:
        engine = [r["engine_ttft_s"] * 1000 for r in requests]
        print(
            f"in-process engine TTFT median {statistics.median(engine):.2f} ms; system - engine: "
            f"p50 difference {statistics.median(total) - statistics.median(engine):.2f} ms, "
            f"median of pairs {statistics.median(t - e for t, e in zip(total, engine)):.2f} ms; "
            f"worker step - engine TTFT median of pairs "
            f"{statistics.median(s - e for s, e in zip(step, engine)):.2f} ms"
        )


def workers_of(layout: str) -> argparse.Namespace:
    """Worker counts for `system_command`: split names one prefill and one decode worker, both one
    both-roles worker (the counts left to `--layout both`), auto none (ferry up decides)."""
    if layout == "split":
        return argparse.Namespace(prefill_workers=1, decode_workers=1, up_args=[])
    up_args = [] if layout == "auto" else ["--layout", layout]
    return argparse.Namespace(prefill_workers=None, decode_workers=None, up_args=up_args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder, .gguf file, or smollm2")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--layout", choices=("auto", "both", "split"), default="auto", help="ferry up's (default auto)")
    p.add_argument("--torch-threads", type=int, default=0, help="per worker and for the engine (0: ferry up's)")
    p.add_argument("--engine", action="store_true", help="pair each request with the engine in-process (as run.py)")
    args = p.parse_args()
    model = resolve_model(args.model)
    engine = make_engine(model, args.torch_threads) if args.engine else None
    trace_file = Path(tempfile.mkdtemp(prefix="ferry-trace-")) / "hops.jsonl"
    workers = workers_of(args.layout)
    workers.torch_threads = args.torch_threads
    env = {**os.environ, "FERRY_TRACE_FILE": str(trace_file)}
    process, base_url = start_system(model, trace_file.parent / "run", workers, env=env)
    try:
        model_name = detect_model(base_url)  # the name the gateway serves it under (no '.gguf')
        vocab_size = read_config(model).vocab_size  # prompts of token ids the model has
        asyncio.run(send_all(base_url, model_name, vocab_size, 2, 10**6))  # warm-up
        trace_file.write_text("")
        stamps = asyncio.run(send_all(base_url, model_name, vocab_size, args.requests, args.seed, engine))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    lines = [json.loads(x) for x in trace_file.read_text().splitlines() if x.strip()]
    summarize(per_request(lines, stamps))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Low-load TTFT of two versions of the services, side by side: before vs after a change.

run.py's rounds differ by a few ms from one another on the shared box, as much as a hop-level
change is worth. This starts two `ferry up` systems at once, one importing the services from
`--baseline` (put first on PYTHONPATH) and one from this tree, and sends every prompt to the
engine in-process and then to both systems (their order alternating), so each prompt gives a
paired difference and the machine's load hits all three alike. Prints p50s and medians of pairs.

A baseline tree: the committed services, bus and protocol, the rest linked to this tree (so engine
changes of others do not count):

    mkdir -p /tmp/base/ferry && git archive HEAD services libs/ferry/bus libs/ferry/protocol | tar -x -C /tmp/base
    mv /tmp/base/services /tmp/base/ferry_services && mv /tmp/base/libs/ferry/* /tmp/base/ferry/
    for e in libs/ferry/*; do [ -e /tmp/base/ferry/$(basename $e) ] || ln -s $PWD/$e /tmp/base/ferry/; done
    .venv/bin/python ops/bench/system/ab.py --model DIR --baseline /tmp/base --prompt-tokens 100
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
from pathlib import Path

import httpx

from ferry.bench.http_client import build_body, stream_completion
from ferry.bench.online import make_calls
from ferry.bench.system.run import engine_ttft, make_engine, start_system, warm_up_system
from ferry.bench.workload import WorkloadConfig, make_workload


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--baseline", type=Path, required=True, help="folder holding ferry_services (and ferry) to compare")
    p.add_argument("--requests", type=int, default=50, help="prompts per seed")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=0, help="cut prompts to this many tokens (0: as drawn)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the summary and every TTFT here (JSON)")
    return p.parse_args()


def start_both(args: argparse.Namespace) -> dict[str, tuple]:
    """{'baseline': (process, url), 'this': (process, url)}; PYTHONPATH is set for the first only."""
    system_args = argparse.Namespace(prefill_workers=1, decode_workers=1, torch_threads=args.torch_threads)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-ab-"))
    baseline = start_system(
        args.model, tmp / "baseline", system_args, env={**os.environ, "PYTHONPATH": str(args.baseline)}
    )
    return {"baseline": baseline, "this": start_system(args.model, tmp / "this", system_args)}


async def measure(engine, systems: dict[str, tuple], args: argparse.Namespace) -> dict[str, list[float]]:
    ttft_ms: dict[str, list[float]] = {"engine": [], "baseline": [], "this": []}
    async with httpx.AsyncClient() as client:
        for seed in range(args.seeds):
            workload = WorkloadConfig(num_requests=args.requests, seed=100 + seed)
            for i, (request, call) in enumerate(zip(make_workload(workload), make_calls(workload, "ids"))):
                if args.prompt_tokens:
                    request.prompt_token_ids = call.prompt = request.prompt_token_ids[: args.prompt_tokens]
                call.max_tokens = 8
                ttft_ms["engine"].append(engine_ttft(engine, [request])[0] * 1000)
                for name in ("baseline", "this") if i % 2 == 0 else ("this", "baseline"):
                    body = build_body(call, args.model.name, "extra")
                    url = f"{systems[name][1]}/v1/completions"
                    result = await stream_completion(client, url, body, call, 0.0, 120.0)
                    if not result.ok:
                        raise SystemExit(f"{name}: {result.error}")
                    assert result.ttft_s is not None  # ok: text streamed
                    ttft_ms[name].append(result.ttft_s * 1000)
    return ttft_ms


def summary(ttft_ms: dict[str, list[float]], load: list[float]) -> dict:
    engine = ttft_ms["engine"]
    out: dict = {"num_prompts": len(engine), "load_average_1min": load, "engine_p50_ms": statistics.median(engine)}
    for name in ("baseline", "this"):
        values = ttft_ms[name]
        out[name] = {
            "p50_ms": statistics.median(values),
            "p50_added_ms": statistics.median(values) - statistics.median(engine),
            "added_median_of_pairs_ms": statistics.median(v - e for v, e in zip(values, engine)),
        }
    out["this_minus_baseline_median_of_pairs_ms"] = statistics.median(
        t - b for t, b in zip(ttft_ms["this"], ttft_ms["baseline"])
    )
    return out


def main() -> int:
    args = parse_args()
    engine = make_engine(args.model, args.torch_threads)
    systems = start_both(args)
    load = [os.getloadavg()[0]]
    try:
        for _, url in systems.values():
            warm_up_system(url, args.model.name)
        ttft_ms = asyncio.run(measure(engine, systems, args))
    finally:
        for process, _ in systems.values():
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    load.append(os.getloadavg()[0])
    result = summary(ttft_ms, load)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "summary": result, "ttft_ms": ttft_ms}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

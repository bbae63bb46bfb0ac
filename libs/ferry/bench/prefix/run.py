"""Prefix-reuse benchmark: TTFT cold vs prefix from the store vs prefix in the pool, hit-rate metric
vs blocks actually reused, and KV transfer time hidden behind compute in the workers.

    python ops/bench/prefix/run.py --out ops/bench/prefix/reports/<name>
writes prefix.json and prefix.png there. Starts its own nats-server and redis-server. The overlap
half runs the services in-process, so ops/bench/prefix/overlap.py (which imports them) passes it in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from ferry.bench.prefix.ttft import measure_ttft
from ferry.launcher.servers import start_nats, start_redis
from ferry.model import load_model
from ferry.model.make_model import make_model


def plot(result: dict, path: Path) -> None:
    from ferry.bench.plots import pyplot

    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ttft = result["ttft"]["ttft_p50_s"]
    left.bar(list(ttft), [v * 1000 for v in ttft.values()], color=["#c44", "#48c", "#4a4"])
    left.set_ylabel("p50 TTFT (ms)")
    left.set_title(f"{result['ttft']['cached_fraction']:.0%} of the prompt cached ({result['model']})")
    roles = ["prefill", "decode"]
    right.bar(roles, [result["overlap"][r]["hidden_fraction"] for r in roles], color="#888")
    right.set_ylim(0, 1)
    right.set_ylabel("KV transfer time hidden behind engine steps")
    right.set_title("put_blocks (prefill) / get_blocks (decode)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


MeasureOverlap = Callable[..., Awaitable[dict]]


async def main_async(args: argparse.Namespace, measure_overlap: MeasureOverlap) -> dict:
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # a shared, loaded box: oversubscribed threads stall
    model_dir = make_model(Path(tempfile.mkdtemp(prefix="ferry-prefix-bench")) / args.model, "llama", args.model)
    lm = load_model(model_dir)
    with start_nats() as nats, start_redis() as redis:
        ttft = await measure_ttft(
            lm, redis.url, system_tokens=args.system_tokens, user_tokens=args.user_tokens, num_requests=args.requests
        )
        overlap = await measure_overlap(str(model_dir), nats.url, redis.url, num_requests=args.overlap_requests)
    return {"model": args.model, "torch_threads": torch.get_num_threads(), "ttft": ttft, "overlap": overlap}


def main(measure_overlap: MeasureOverlap) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="bench", choices=["tiny", "bench"])
    parser.add_argument("--system-tokens", type=int, default=576)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--overlap-requests", type=int, default=16)
    parser.add_argument("--torch-threads", type=int, default=0, help="0 = torch's default")
    args = parser.parse_args()
    result = asyncio.run(main_async(args, measure_overlap))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "prefix.png")
    print(
        json.dumps(
            {
                "ttft_p50_s": result["ttft"]["ttft_p50_s"],
                "speedup_p50": result["ttft"]["speedup_p50"],
                "hidden": {r: result["overlap"][r]["hidden_fraction"] for r in ("prefill", "decode")},
            }
        )
    )

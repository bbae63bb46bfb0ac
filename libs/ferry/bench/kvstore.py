"""KV-store transfer benchmark: `python -m ferry.bench.kvstore --out DIR` -> DIR/kvstore.json + .png.

Measures, side by side in one run on the same blocks, put_blocks / get_blocks / lookup for chains
of 1..64 blocks of the `bench` model (8 layers, K and V, 16 tokens, 4 KV heads of 64, fp32: 256 KiB
a block) over a local redis-server, the in-process memory transport and the shared-memory (tmpfs)
transport, plus the same Redis puts and
gets issued one block per round trip, which is what pipelining saves. Medians of `--repeats` runs;
absolute times are context (shared machines are noisy), the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ferry.kvstore.redis_transport import RedisTransport
from ferry.kvstore.shm_transport import ShmTransport
from ferry.kvstore.store import KvStore
from ferry.kvstore.transport import MemoryTransport
from ferry.protocol import hash_full_blocks

BENCH_BLOCK_SHAPE = (8, 2, 16, 4, 64)  # [layers, K/V, block_size, kv_heads, head_dim]


async def _one_per_trip(store: KvStore, hashes: list[bytes], data: torch.Tensor, op: str) -> None:
    for i, h in enumerate(hashes):
        if op == "put":
            await store.put_blocks([h], data[i : i + 1])
        else:
            await store.get_blocks([h])


def _ops(store: KvStore, hashes: list[bytes], data: torch.Tensor, per_block: bool) -> dict:
    ops = {
        "put_ms": lambda: store.put_blocks(hashes, data),
        "get_ms": lambda: store.get_blocks(hashes),
        "lookup_ms": lambda: store.lookup(hashes),
    }
    if per_block:
        ops["put_one_per_trip_ms"] = lambda: _one_per_trip(store, hashes, data, "put")
        ops["get_one_per_trip_ms"] = lambda: _one_per_trip(store, hashes, data, "get")
    return ops


async def measure(stores: dict[str, KvStore], num_blocks: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median ms of every op on every transport; the ops take turns, so load spikes hit them all alike."""
    data = torch.randn((num_blocks, *BENCH_BLOCK_SHAPE))  # [n, *block_shape]
    hashes = hash_full_blocks(list(range(16 * num_blocks)), 16)
    ops = {name: _ops(store, hashes, data, per_block=name == "redis") for name, store in stores.items()}
    times: dict[str, dict[str, list[float]]] = {name: {op: [] for op in o} for name, o in ops.items()}
    for store in stores.values():
        await store.put_blocks(hashes, data)
        got = await store.get_blocks(hashes)
        assert got is not None and torch.equal(got, data)
    for _ in range(repeats):
        for name, named_ops in ops.items():
            for op, fn in named_ops.items():
                start = time.perf_counter()
                await fn()
                times[name][op].append((time.perf_counter() - start) * 1e3)
    mib = data.numel() * data.element_size() / 2**20
    return {
        name: {"mib": mib, **{op: statistics.median(t) for op, t in per_op.items()}} for name, per_op in times.items()
    }


async def run(redis_url: str, block_counts: list[int], repeats: int) -> dict:
    redis = RedisTransport(redis_url)
    shm_root = tempfile.mkdtemp(prefix="ferry-kv-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)  # noqa: ASYNC240
    results: dict = {"block_shape": list(BENCH_BLOCK_SHAPE), "dtype": "float32", "repeats": repeats, "rows": []}
    try:
        for n in block_counts:
            stores = {
                "redis": KvStore(redis, f"bench-{n}"),
                "memory": KvStore(MemoryTransport(), "bench"),
                "shm": KvStore(ShmTransport(shm_root), f"bench-{n}"),
            }
            row: dict[str, Any] = await measure(stores, n, repeats)
            r = row["redis"]
            row.update(
                num_blocks=n,
                pipelined_put_speedup=r["put_one_per_trip_ms"] / r["put_ms"],
                pipelined_get_speedup=r["get_one_per_trip_ms"] / r["get_ms"],
            )
            results["rows"].append(row)
    finally:
        await redis.close()
        ShmTransport(shm_root).clear()
    return results


def plot(results: dict, path: Path) -> None:
    from ferry.bench.plots import pyplot

    plt = pyplot()

    ns = [r["num_blocks"] for r in results["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for where, key, style in [
        ("redis", "put_ms", "o-"),
        ("redis", "get_ms", "s-"),
        ("redis", "put_one_per_trip_ms", "o--"),
        ("redis", "get_one_per_trip_ms", "s--"),
        ("memory", "put_ms", "o:"),
        ("memory", "get_ms", "s:"),
        ("shm", "put_ms", "o-."),
        ("shm", "get_ms", "s-."),
    ]:
        ax.plot(ns, [r[where][key] for r in results["rows"]], style, label=f"{where} {key[:-3]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("blocks per call (256 KiB each)")
    ax.set_ylabel("median ms per call")
    ax.set_title("ferry.kvstore transfer time: Redis (pipelined, one block per trip), memory, shm")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _summary(row: dict) -> str:
    r, m, shm = row["redis"], row["memory"], row["shm"]
    return (
        f"{row['num_blocks']:3d} blocks ({r['mib']:.2f} MiB): redis put {r['put_ms']:.2f} ms "
        f"get {r['get_ms']:.2f} ms lookup {r['lookup_ms']:.2f} ms | one block per trip: put "
        f"x{row['pipelined_put_speedup']:.1f} get x{row['pipelined_get_speedup']:.1f} slower | "
        f"memory put {m['put_ms']:.2f} get {m['get_ms']:.2f} | shm put {shm['put_ms']:.2f} get {shm['get_ms']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="", help="default: start a local redis-server")
    parser.add_argument("--blocks", default="1,8,64", help="comma-separated chain lengths")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True, help="folder for kvstore.json and kvstore.png")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.blocks.split(",")]
    if args.redis_url:
        results = asyncio.run(run(args.redis_url, counts, args.repeats))
    else:
        from ferry.launcher.servers import start_redis

        with start_redis() as server:
            results = asyncio.run(run(server.url, counts, args.repeats))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kvstore.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "kvstore.png")
    for row in results["rows"]:
        print(_summary(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

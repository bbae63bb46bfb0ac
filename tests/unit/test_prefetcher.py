"""The prefill worker's Prefetcher without NATS or Redis: requests' prefetches run before turn-end
warm-ups, and an admitted prompt takes back the unstarted warm-ups of its own blocks (it fetches them
itself, once) while other conversations' warm-ups stay queued."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from ferry.protocol import KvPrefetch
from ferry_services.worker.prefetch import Prefetcher

pytestmark = pytest.mark.unit


class FakeWorker:
    namespace = "ns"

    def __init__(self) -> None:
        self.fetched: list[list[bytes]] = []
        self.engine = SimpleNamespace(
            host=object(), num_cached_blocks=lambda hashes: 0, prefetch_to_host=None, drain_host_events=None
        )
        self.published: list = []
        self.store = SimpleNamespace(get_blocks=self.get_blocks)
        self.compute = SimpleNamespace(call=self.call)

    async def get_blocks(self, hashes):
        self.fetched.append(list(hashes))
        return torch.zeros(len(hashes), 1)

    async def call(self, fn, *args):
        return len(args[0]) if args else (["h"], [])

    async def publish_pool_changes(self, device, host) -> None:
        self.published.append(host)


def _hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


async def test_requests_prefetches_run_before_warm_ups():
    worker = FakeWorker()
    prefetcher = Prefetcher(worker)
    await prefetcher.offer(KvPrefetch("warm-a", "ns", _hashes("a", 2), warm=True))
    await prefetcher.offer(KvPrefetch("req-b", "ns", _hashes("b", 2)))
    task = asyncio.create_task(prefetcher.run())
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert worker.fetched == [_hashes("b", 2), _hashes("a", 2)]
        assert prefetcher.stats.num_warm == 1 and prefetcher.stats.num_fetched_blocks == 4
        assert worker.published == [(["h"], [])] * 2  # each fetch's host-tier events went out at once
    finally:
        task.cancel()


async def test_an_admission_takes_back_the_unstarted_warm_ups_of_its_blocks():
    worker = FakeWorker()
    prefetcher = Prefetcher(worker)
    await prefetcher.offer(KvPrefetch("warm-a", "ns", _hashes("a", 2), warm=True))
    await prefetcher.offer(KvPrefetch("warm-c", "ns", _hashes("c", 2), warm=True))
    # conversation a's next turn: the system prompt's blocks (s*) and a's history
    await prefetcher.settle("req-a2", _hashes("s", 3) + _hashes("a", 2) + _hashes("new", 1))
    assert prefetcher.stats.num_dropped == 1
    task = asyncio.create_task(prefetcher.run())
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert worker.fetched == [_hashes("c", 2)]  # conversation c's warm-up still ran
    finally:
        task.cancel()

"""The host tier of a prefill worker, over real nats-server and redis-server: prompt blocks its
small pool evicts are kept in host memory, announced as tier 'host' on `ferry.kv.events`, and a
later prompt with that prefix loads them back (counted per tier) with the exact greedy tokens."""

from __future__ import annotations

import asyncio

import pytest
from test_prefix_reuse import FIRST, PREFIX, SECOND, client, reference, serve, tiny_model  # noqa: F401
from test_worker_pipeline import System

from ferry.protocol import KvEvent, decode, hash_full_blocks, subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OTHER = [(11 * i + 7) % 200 + 3 for i in range(80)]  # 5 full blocks of its own


@pytest.fixture
async def small_pool_system(nc, nats_url, redis_url, redis, tiny_model):
    # 7 blocks: FIRST's prefix is pushed out of the pool by OTHER's prefill
    system = System(nats_url, redis_url, tiny_model, num_kv_blocks=7, host_kv_blocks=32)
    await system.start()
    await asyncio.sleep(0.5)  # first load reports reach the balancers
    yield system
    await system.stop()


async def test_evicted_prefix_comes_back_from_the_host_tier(small_pool_system, nc, client, reference):
    events: list[KvEvent] = []

    async def collect(msg) -> None:
        events.append(decode(msg.data))

    await nc.subscribe(subjects.KV_EVENTS, cb=collect)
    prefill = small_pool_system.workers["prefill-t"]
    await serve(client, "first", FIRST)
    await serve(client, "other", OTHER)
    prefix_hashes = hash_full_blocks(PREFIX, 16)
    device, host = prefill.engine.cached_tiers(prefix_hashes)
    assert host > 0 and device + host == len(prefix_hashes)

    assert await serve(client, "second", SECOND) == reference
    tiers = prefill.prefix_blocks_by_tier
    assert (tiers["device"], tiers["host"], tiers["remote"]) == (device, host, 0)
    assert prefill.engine.stats().num_host_hit_blocks == host
    await nc.flush()
    await asyncio.sleep(0.2)
    host_stored = {h for e in events if e.tier == "host" and e.kind == "stored" for h in e.block_hashes}
    assert set(prefix_hashes[device:]) <= host_stored
    assert all(e.where == prefill.worker_id for e in events if e.tier == "host")

"""The kvcache service over real NATS and Redis, talked to as the balancers and workers do."""

import asyncio
import json
import logging

import pytest
import torch
from prometheus_client import REGISTRY
from waiting import wait_until

from ferry.kvstore import KvStore, RedisTransport, block_key
from ferry.launcher.servers import start_redis
from ferry.protocol import (
    ErrorReply,
    KvEvent,
    KvLookup,
    KvLookupReply,
    KvStats,
    KvStatsRequest,
    decode,
    encode,
    hash_full_blocks,
    subjects,
)
from ferry_services.kvcache.service import serve
from ferry_services.kvcache.settings import KvCacheSettings

pytestmark = pytest.mark.integration

NS = "llama:float32:kv1:test"
BLOCK = (2, 2, 16, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]: 4 KiB of float32


def chain(n, seed=0):
    return hash_full_blocks([seed * 7919 + i for i in range(16 * n)], 16)


async def ask(nc, subject, msg):
    reply = await nc.request(subject, encode(msg), timeout=3)
    return decode(reply.data)


async def stats(nc, namespace=""):
    return await ask(nc, subjects.KV_STATS, KvStatsRequest(kv_namespace=namespace))


class Running:
    """The service in this event loop (the same `serve` as `python -m ferry_services.kvcache`)."""

    def __init__(self, nats_url, redis_url, **settings):
        self.settings = KvCacheSettings(
            nats_url=nats_url,
            redis_url=redis_url,
            kv_health_interval_s=0.2,
            kv_event_flush_s=0.01,
            kv_redis_timeout_s=0.5,
            **settings,
        )
        self.stop = asyncio.Event()

    async def __aenter__(self):
        self.task = asyncio.create_task(serve(self.settings, self.stop))
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        assert await asyncio.wait_for(self.task, 10) == 0


async def healthy(nc):
    async def check():
        try:
            s = await stats(nc)
        except Exception:  # not subscribed yet: no responders
            return None
        return s if isinstance(s, KvStats) and not s.degraded else None

    return await wait_until(check, "the kvcache stats")


@pytest.fixture
async def store(redis_url, redis):
    transport = RedisTransport(redis_url)
    yield KvStore(transport, NS)
    await transport.close()


async def test_lookup_answers_the_leading_stored_blocks(nc, nats_url, redis_url, store, redis):
    hashes = chain(6)
    async with Running(nats_url, redis_url):
        await healthy(nc)
        await store.put_blocks(hashes[:4], torch.zeros(4, *BLOCK))
        await redis.delete(block_key(NS, hashes[2]))
        reply = await ask(nc, subjects.KV_LOOKUP, KvLookup(kv_namespace=NS, block_hashes=hashes))
        assert reply == KvLookupReply(num_cached_blocks=2)
        other = await ask(nc, subjects.KV_LOOKUP, KvLookup(kv_namespace="other-model", block_hashes=hashes))
        assert other.num_cached_blocks == 0
        bad = await ask(nc, subjects.KV_LOOKUP, KvLookup(kv_namespace=NS, block_hashes=[b"short"]))
        assert isinstance(bad, ErrorReply) and bad.code == "bad_request"


async def test_stats_count_blocks_bytes_and_lookup_hits(nc, nats_url, redis_url, store, redis):
    await store.put_blocks(chain(3, seed=1), torch.ones(3, *BLOCK))  # before the service starts: found by its scan
    async with Running(nats_url, redis_url):
        await healthy(nc)
        await store.put_blocks(chain(2, seed=2), torch.ones(2, *BLOCK))
        s = await wait_until(lambda: _stats_with_blocks(nc, 5), "stats with 5 blocks")
        assert s.num_bytes > 5 * 4096 and s.blocks_per_namespace == {NS: 5}
        assert s.eviction_policy == "allkeys-lru" and s.used_memory_bytes > 0
        lookups_before, hits_before = _counter("ferry_kv_store_lookups"), _counter("ferry_kv_store_hits")
        await ask(nc, subjects.KV_LOOKUP, KvLookup(kv_namespace=NS, block_hashes=chain(3, seed=1) + chain(1, 9)))
        s = await stats(nc, NS)
        assert (s.num_lookups, s.lookup_hit_rate) == (1, 0.75)
        # the dashboard's KV store hit rate: 4 blocks asked, 3 found
        assert _counter("ferry_kv_store_lookups") - lookups_before == 4
        assert _counter("ferry_kv_store_hits") - hits_before == 3
        assert (await stats(nc, "other-model")).num_blocks == 0
        micro = json.loads((await nc.request("$SRV.STATS.kvcache", b"", timeout=3)).data)
        by_name = {e["name"]: e for e in micro["endpoints"]}
        assert (by_name["lookup"]["num_requests"], by_name["key_events"]["num_requests"]) == (1, 2)  # 2 SETs seen
        assert by_name["key_events"]["data"]["num_blocks"] == 5


def _counter(name: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_total") or 0.0


async def _stats_with_blocks(nc, n):
    s = await stats(nc)
    return s if s.num_blocks == n else None


async def test_events_are_published_when_blocks_are_stored_and_removed(nc, nats_url, redis_url, store, redis):
    sub, events = await subscribe_events(nc)
    hashes = chain(3, seed=3)
    async with Running(nats_url, redis_url):
        await healthy(nc)
        await store.put_blocks(hashes, torch.ones(3, *BLOCK))
        stored = await _next_event(events, "stored")
        assert (stored.kv_namespace, stored.where, stored.block_hashes) == (NS, "store", hashes)
        await redis.delete(block_key(NS, hashes[1]))
        removed = await _next_event(events, "removed")
        assert removed.block_hashes == [hashes[1]]
    await sub.unsubscribe()


async def subscribe_events(nc):
    events: asyncio.Queue[KvEvent] = asyncio.Queue()

    async def on_event(msg):
        events.put_nowait(decode(msg.data, KvEvent))

    return await nc.subscribe(subjects.KV_EVENTS, cb=on_event), events


async def _next_event(events, kind):
    while True:
        event = await asyncio.wait_for(events.get(), 10)
        if event.kind == kind:
            return event


async def test_capacity_is_set_on_start_and_lru_evictions_are_counted(nc, nats_url):
    evictions_before = _counter("ferry_kv_store_evictions")
    sub, events = await subscribe_events(nc)
    with start_redis() as server:  # its own Redis: maxmemory must not squeeze the shared one
        transport = RedisTransport(server.url)
        store = KvStore(transport, NS)
        async with Running(nats_url, server.url, kv_max_memory="4mb"):
            s = await healthy(nc)
            assert (s.max_memory_bytes, s.eviction_policy) == (4 << 20, "allkeys-lru")
            big = torch.ones(1, 64, 1024)  # 256 KiB per block
            hashes = chain(40, seed=4)
            for h in hashes[:8]:  # 2 MiB: fits, and the service indexes them
                await store.put_blocks([h], big)
            await wait_until(lambda: _stats_with_blocks(nc, 8), "stats with 8 blocks")
            for h in hashes[8:]:  # 8 MiB more into a 4 MiB Redis: LRU evicts, among others, indexed blocks
                await store.put_blocks([h], big)
            removed = await _next_event(events, "removed")
            assert removed.kv_namespace == NS and set(removed.block_hashes) <= set(hashes)
            s = await wait_until(lambda: _stats_with_evictions(nc), "stats with evictions")
            assert s.num_blocks < 40
            # what the "KV store near full" alert and the dashboard read
            assert _counter("ferry_kv_store_evictions") - evictions_before == s.num_evictions
            assert REGISTRY.get_sample_value("ferry_kv_store_max_bytes") == 4 << 20
            assert REGISTRY.get_sample_value("ferry_kv_store_used_bytes") > 0
        await transport.close()
    await sub.unsubscribe()


async def _stats_with_evictions(nc):
    s = await stats(nc)
    return s if s.num_evictions > 0 else None


async def test_noeviction_redis_gets_a_loud_warning(nc, nats_url, caplog):
    with start_redis() as server, caplog.at_level(logging.WARNING, logger="ferry.kvcache"):
        async with Running(nats_url, server.url, kv_eviction_policy="noeviction"):
            assert (await healthy(nc)).eviction_policy == "noeviction"
    assert any("noeviction" in r.getMessage() and "FAILS" in r.getMessage() for r in caplog.records)


async def test_redis_outage_degrades_the_service_which_recovers_by_itself(nc, nats_url):
    sub, events = await subscribe_events(nc)
    server = start_redis()
    transport = RedisTransport(server.url)
    try:
        async with Running(nats_url, server.url):
            await healthy(nc)
            await KvStore(transport, NS).put_blocks(chain(2), torch.ones(2, *BLOCK))
            await _next_event(events, "stored")
            server.stop()
            s = await wait_until(lambda: _degraded_stats(nc), "degraded stats")
            assert s.num_blocks == 2  # last known, flagged as such
            reply = await ask(nc, subjects.KV_LOOKUP, KvLookup(kv_namespace=NS, block_hashes=chain(2)))
            assert isinstance(reply, ErrorReply) and reply.code == "kv_unavailable"
            info = json.loads((await nc.request("$SRV.INFO.kvcache", b"", timeout=3)).data)
            assert info["metadata"]["degraded"] == "true"

            server = start_redis(port=server.port)  # back, empty and unconfigured
            s = await healthy(nc)
            assert (s.num_blocks, s.eviction_policy) == (0, "allkeys-lru")
            assert (await _next_event(events, "cleared")).kv_namespace == NS
            info = json.loads((await nc.request("$SRV.INFO.kvcache", b"", timeout=3)).data)
            assert info["metadata"]["degraded"] == "false"
            reply = await ask(nc, subjects.KV_LOOKUP, KvLookup(kv_namespace=NS, block_hashes=chain(2)))
            assert reply == KvLookupReply(num_cached_blocks=0)
    finally:
        await transport.close()
        server.stop()
        await sub.unsubscribe()


async def _degraded_stats(nc):
    s = await stats(nc)
    return s if s.degraded else None

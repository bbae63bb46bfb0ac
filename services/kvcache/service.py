"""kvcache service: the control plane of the KV store.

Reads `ferry.kv.lookup` (KvLookup -> KvLookupReply: leading blocks of a chain stored in Redis) and
`ferry.kv.stats` (KvStatsRequest -> KvStats); writes `ferry.kv.events` (KvEvent, where='store'),
batched per namespace, from Redis keyspace notifications (counted as the `key_events` input), and
everything it holds again on `ferry.kv.resync` (a prefill-balancer rebuilding its index).
Registers as NATS micro `kvcache`, whose metadata says `degraded: true|false`. Block bytes never
pass through here: workers talk to Redis through `ferry.kvstore` directly.

When Redis goes away, lookups answer `ErrorReply(code='kv_unavailable')`, stats say degraded, and
the watch loop retries every `kv_health_interval_s`; once Redis answers again it re-applies the
capacity settings (a restarted Redis forgets CONFIG SET), rescans, publishes what changed, and the
service is healthy again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from redis.exceptions import RedisError

from ferry import metrics
from ferry.bus import BusError, Service, connect, run_service
from ferry.kvstore import KvStoreError, KvStoreUnavailable, RedisTransport, block_key, num_leading_present
from ferry.kvstore.index import BlockIndex
from ferry.kvstore.keys import parse_block_key
from ferry.metrics import start_metrics_server
from ferry.protocol import KvEvent, KvLookup, KvLookupReply, KvResync, KvStats, KvStatsRequest, encode, subjects
from ferry_services.kvcache import redis_admin
from ferry_services.kvcache.settings import KvCacheSettings

log = logging.getLogger("ferry.kvcache")

VERSION = "0.1.0"
_REDIS_DOWN = (KvStoreError, RedisError, OSError, asyncio.TimeoutError)


class KvCache:
    """Handlers and the Redis watch loop; `publish` sends one KvEvent on the bus. The Redis keyspace
    events it follows are an input of `service`: counted in `nats micro stats kvcache` (`key_events`)."""

    def __init__(
        self, settings: KvCacheSettings, publish: Callable[[KvEvent], Awaitable[None]], service: Service
    ) -> None:
        self.settings = settings
        self.transport = RedisTransport(settings.redis_url, timeout_s=settings.kv_redis_timeout_s)
        self.client = self.transport.client
        self.index = BlockIndex()
        self.capacity = redis_admin.RedisCapacity(0, "")
        self.degraded = True  # until the first successful connect
        self.degraded_reason = "not connected yet"
        self.on_health_change: Callable[[bool, str], None] = lambda degraded, reason: None
        self.num_evictions = 0
        self.num_lookups = 0
        self.num_lookup_blocks = 0
        self.num_lookup_hits = 0
        self._publish = publish
        self._pending_sets: list[bytes] = []
        pattern = redis_admin.keyevent_pattern(self.client)
        self.key_events = service.input("key_events", pattern, data=self.held)

    def held(self) -> dict:
        """What the index holds, for the `data` of `key_events` in $SRV.STATS."""
        return {
            "num_blocks": self.index.num_blocks(None),
            "num_bytes": self.index.num_bytes(None),
            "num_evictions": self.num_evictions,
            "degraded": self.degraded,
        }

    # -- endpoints ------------------------------------------------------------------------------

    async def lookup(self, request: KvLookup) -> KvLookupReply:
        if not request.kv_namespace:
            raise BusError("bad_request", "kv_namespace must not be empty")
        try:
            keys = [block_key(request.kv_namespace, h) for h in request.block_hashes]
        except ValueError as exc:
            raise BusError("bad_request", f"block_hashes: {exc}") from None
        try:
            num_cached = await num_leading_present(self.transport, keys)
        except KvStoreUnavailable as exc:
            self._set_degraded(True, str(exc))
            raise BusError("kv_unavailable", str(exc)) from None
        self.num_lookups += 1
        self.num_lookup_blocks += len(keys)
        self.num_lookup_hits += num_cached
        metrics.KV_STORE_LOOKUPS.inc(len(keys))
        metrics.KV_STORE_HITS.inc(num_cached)
        return KvLookupReply(num_cached_blocks=num_cached)

    async def stats(self, request: KvStatsRequest) -> KvStats:
        namespace = request.kv_namespace or None
        return KvStats(
            num_blocks=self.index.num_blocks(namespace),
            num_bytes=self.index.num_bytes(namespace),
            num_lookups=self.num_lookups,
            lookup_hit_rate=self.num_lookup_hits / self.num_lookup_blocks if self.num_lookup_blocks else 0.0,
            num_evictions=self.num_evictions,
            degraded=self.degraded,
            max_memory_bytes=self.capacity.max_memory_bytes,
            eviction_policy=self.capacity.eviction_policy,
            used_memory_bytes=await self._used_memory(),
            blocks_per_namespace=self.index.blocks_per_namespace(),
        )

    async def _used_memory(self) -> int:
        if self.degraded:
            return 0
        try:
            return int((await self.client.info("memory")).get("used_memory", 0))
        except _REDIS_DOWN as exc:
            self._set_degraded(True, f"INFO failed: {exc}")
            return 0

    # -- watching Redis ---------------------------------------------------------------------------

    async def watch(self, stop: asyncio.Event) -> None:
        """Follow Redis until `stop`; on any Redis failure mark degraded and reconnect."""
        while not stop.is_set():
            try:
                await self._watch_once(stop)
            except _REDIS_DOWN as exc:
                log.debug("Redis watch failed", exc_info=True)
                self._set_degraded(True, f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):  # stale pooled connections would fail the next try
                    await self.client.connection_pool.disconnect()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.kv_health_interval_s)

    async def _watch_once(self, stop: asyncio.Event) -> None:
        pubsub = self.client.pubsub()
        try:
            self.capacity = await redis_admin.configure(
                self.client, self.settings.kv_max_memory, self.settings.kv_eviction_policy
            )
            # Subscribe before scanning: a block stored meanwhile shows up in one or both, never in neither.
            await pubsub.psubscribe(redis_admin.keyevent_pattern(self.client))
            self._pending_sets.clear()
            self.index.resync(await redis_admin.scan_blocks(self.client))
            await self._publish_changes()
            self._set_degraded(False, "")
            await self._sample_memory()
            await self._follow(pubsub, stop)
        finally:
            with contextlib.suppress(Exception):  # the connection may already be dead
                await pubsub.aclose()

    async def _follow(self, pubsub, stop: asyncio.Event) -> None:
        """Apply key events; publish them `kv_event_flush_s` after the first of a batch; ping meanwhile."""
        flush_s, ping_s = self.settings.kv_event_flush_s, self.settings.kv_health_interval_s
        next_ping, next_flush = time.monotonic() + ping_s, math.inf  # inf: nothing waiting to publish
        while not stop.is_set():
            timeout_s = max(min(next_flush, next_ping) - time.monotonic(), 0.0)
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
            if msg is not None:
                start_ns = time.perf_counter_ns()
                if self._on_key_event(redis_admin.event_of(msg["channel"]), msg["data"]):
                    next_flush = min(next_flush, time.monotonic() + flush_s)
                self.key_events.record(time.perf_counter_ns() - start_ns)
            now = time.monotonic()
            if now >= next_flush:
                await self._flush()
                next_flush = math.inf
            if now >= next_ping:  # a silent pubsub connection proves nothing; a request does
                await self._sample_memory()
                next_ping = now + ping_s

    def _on_key_event(self, event: str, key: bytes) -> bool:
        """Record one keyspace event; True if it concerns a block."""
        parsed = parse_block_key(key)
        if parsed is None or event not in redis_admin.KEY_EVENTS:
            return False
        if event == "set":
            self._pending_sets.append(key)  # sized in one pipeline at the next flush
            return True
        self.index.removed(*parsed)
        if event == "evicted":
            self.num_evictions += 1
            metrics.KV_STORE_EVICTIONS.inc()
        return True

    async def _sample_memory(self) -> None:
        """Redis's memory for the `near full` alert; raises like ping() when Redis is gone."""
        used = int((await self.client.info("memory")).get("used_memory", 0))
        metrics.KV_STORE_USED_BYTES.set(used)
        metrics.KV_STORE_MAX_BYTES.set(self.capacity.max_memory_bytes)

    async def _flush(self) -> None:
        keys, self._pending_sets = self._pending_sets, []
        if keys:
            for key, size in zip(keys, await redis_admin.block_sizes(self.client, keys)):
                parsed = parse_block_key(key)  # never None: only block keys are queued
                if size and parsed is not None:  # size 0: deleted again before we looked; its del event follows
                    self.index.stored(*parsed, size)
        await self._publish_changes()

    async def republish(self, request: KvResync) -> None:
        """A prefill-balancer (re)started: everything the store holds, as 'stored' events."""
        log.info("republishing the store's blocks for %s", request.requester or "a balancer")
        await self._publish_changes(self.index.contents())

    async def _publish_changes(self, changes: list | None = None) -> None:
        now = time.time()
        for change in self.index.drain_changes() if changes is None else changes:
            event = KvEvent(
                kind=change.kind,
                kv_namespace=change.namespace,
                where="store",
                block_hashes=change.block_hashes,
                timestamp=now,
                tier="remote",
            )
            try:
                await self._publish(event)
            except Exception:  # NATS trouble must not stop the Redis watch; balancers resync on 'cleared'
                log.warning("could not publish a KV event", exc_info=True)

    def _set_degraded(self, degraded: bool, reason: str) -> None:
        if degraded == self.degraded:
            return
        self.degraded, self.degraded_reason = degraded, reason
        if degraded:
            log.warning(
                "kvcache DEGRADED: Redis unavailable (%s); retrying every %.1fs",
                reason,
                self.settings.kv_health_interval_s,
            )
        else:
            log.info("kvcache healthy: Redis %s answers", self.transport.url)
        self.on_health_change(degraded, reason)

    async def close(self) -> None:
        await self.transport.close()


def build(settings: KvCacheSettings, nc: Client) -> tuple[Service, KvCache]:
    """The micro service with both endpoints, and the KvCache behind them."""

    async def publish(event: KvEvent) -> None:
        await nc.publish(subjects.KV_EVENTS, encode(event))

    svc = Service("kvcache", version=VERSION, description="KV cache control plane: lookup, stats, KV events")
    cache = KvCache(settings, publish, svc)
    svc.metadata.update(degraded="true", degraded_reason=cache.degraded_reason)

    def on_health_change(degraded: bool, reason: str) -> None:
        svc.metadata.update(degraded="true" if degraded else "false", degraded_reason=reason)

    cache.on_health_change = on_health_change
    svc.endpoint(subjects.KV_LOOKUP, KvLookup, cache.lookup, name="lookup")
    svc.endpoint(subjects.KV_STATS, KvStatsRequest, cache.stats, name="stats")
    svc.subscribe(subjects.KV_RESYNC, KvResync, cache.republish, name="resync")
    return svc, cache


async def serve(settings: KvCacheSettings, stop: asyncio.Event | None = None) -> int:
    nc = await connect(settings.nats_url, name="kvcache")
    svc, cache = build(settings, nc)
    start_metrics_server(settings.metrics_port)
    try:
        return await run_service(nc, svc, background=[cache.watch(svc.draining)], stop=stop)
    finally:
        await cache.close()

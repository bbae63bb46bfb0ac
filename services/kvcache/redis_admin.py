"""The service's own Redis calls: capacity settings, keyspace notifications, full scans.

Workers write blocks straight to Redis; this module only configures Redis and reads what it holds.
A Redis restarted without its config (or a managed Redis that forbids CONFIG) is expected: the
service re-applies the settings after every reconnect and says loudly what it could not set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from ferry.kvstore.keys import namespace_pattern, parse_block_key

log = logging.getLogger("ferry.kvcache")

NOTIFY_FLAGS = "Eg$xe"
"""Keyevent notifications for generic (del), string (set), expired and evicted events."""
KEY_EVENTS = ("set", "del", "expired", "evicted")
SCAN_COUNT = 1000


@dataclass(slots=True)
class RedisCapacity:
    max_memory_bytes: int
    eviction_policy: str


async def configure(client: aioredis.Redis, max_memory: str, policy: str) -> RedisCapacity:
    """Apply maxmemory/policy and keyspace notifications; warn about what would hurt."""
    wanted = {"maxmemory-policy": policy}
    if max_memory:
        wanted["maxmemory"] = max_memory
    for name, value in wanted.items():
        await _config_set(client, name, value)
    current = await _config_get(client, "notify-keyspace-events")
    flags = "".join(sorted(set(current + NOTIFY_FLAGS)))
    if not set(NOTIFY_FLAGS) <= set(current) and not await _config_set(client, "notify-keyspace-events", flags):
        log.warning("keyspace notifications are off: ferry.kv.events will miss stores and evictions")
    capacity = RedisCapacity(
        int(await _config_get(client, "maxmemory") or 0), await _config_get(client, "maxmemory-policy")
    )
    _warn_about(capacity)
    return capacity


def _warn_about(capacity: RedisCapacity) -> None:
    if capacity.eviction_policy == "noeviction":
        log.warning(
            "!!! Redis maxmemory-policy is 'noeviction': when it is full every KV block write FAILS "
            "(workers fall back to recompute). Set FERRY_KV_EVICTION_POLICY=allkeys-lru or fix Redis. !!!"
        )
    if capacity.max_memory_bytes == 0:
        log.warning(
            "Redis has no maxmemory: the KV store grows until the host runs out of memory "
            "(set FERRY_KV_MAX_MEMORY, e.g. 2gb)"
        )
    log.info("Redis capacity: maxmemory=%d bytes, policy=%s", capacity.max_memory_bytes, capacity.eviction_policy)


async def _config_set(client: aioredis.Redis, name: str, value: str) -> bool:
    try:
        await client.config_set(name, value)
        return True
    except ResponseError as exc:  # managed Redis (CONFIG renamed/forbidden) or a bad value
        log.warning("could not set Redis %s=%s: %s", name, value, exc)
        return False


async def _config_get(client: aioredis.Redis, name: str) -> str:
    try:
        found = await client.config_get(name)  # keys and values are str whatever decode_responses says
        return found.get(name) or ""
    except ResponseError as exc:
        log.warning("could not read Redis %s: %s", name, exc)
        return ""


def keyevent_pattern(client: aioredis.Redis) -> str:
    db = client.connection_pool.connection_kwargs.get("db", 0)
    return f"__keyevent@{db}__:*"


def event_of(channel: bytes) -> str:
    """'set' from b'__keyevent@0__:set'."""
    return channel.decode(errors="replace").rpartition(":")[2]


async def block_sizes(client: aioredis.Redis, keys: list[bytes]) -> list[int]:
    """Stored bytes of each key (0 for a key that is gone again)."""
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.strlen(key)
        return await pipe.execute()


async def scan_blocks(client: aioredis.Redis) -> dict[str, dict[bytes, int]]:
    """Every block key Redis holds now, with its size: namespace -> {hash: bytes}."""
    snapshot: dict[str, dict[bytes, int]] = {}
    batch: list[bytes] = []
    async for key in client.scan_iter(match=namespace_pattern(), count=SCAN_COUNT):
        batch.append(key)
        if len(batch) >= SCAN_COUNT:
            await _add_sizes(client, batch, snapshot)
            batch = []
    await _add_sizes(client, batch, snapshot)
    return snapshot


async def _add_sizes(client: aioredis.Redis, keys: list[bytes], snapshot: dict[str, dict[bytes, int]]) -> None:
    for key, size in zip(keys, await block_sizes(client, keys) if keys else []):
        parsed = parse_block_key(key)
        if parsed is not None and size:
            snapshot.setdefault(parsed[0], {})[parsed[1]] = size

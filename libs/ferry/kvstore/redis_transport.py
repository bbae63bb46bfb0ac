"""The default data-plane transport: Redis (or Valkey) through redis.asyncio, pipelined.

Every batch is one pipeline (transaction off: blocks are independent, and each SET is atomic on its
own, so a block is visible only when complete). Pipelines of single-key commands, unlike MGET/MSET,
also work on a Redis Cluster. Retries are off and timeouts short on purpose: when Redis is gone the
worker must learn it within `timeout_s` and recompute, not hang in a reconnect loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ferry.kvstore.errors import KvStoreError, KvStoreUnavailable
from ferry.redact import redact_url

T = TypeVar("T")
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


def connect_redis(url: str, timeout_s: float = 2.0) -> aioredis.Redis:
    """A redis.asyncio client that fails fast (no retries, `timeout_s` for connect and replies)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=False,
    )


async def call_redis(what: str, url: str, op: Callable[[], Awaitable[T]]) -> T:
    """Run one Redis call, mapping its failures onto the store's exception types."""
    try:
        return await op()
    except _UNREACHABLE as exc:
        raise KvStoreUnavailable(f"redis at {url} unreachable during {what}: {exc}") from exc
    except RedisError as exc:  # e.g. OOM under maxmemory-policy noeviction
        raise KvStoreError(f"redis at {url} refused {what}: {exc}") from exc


class RedisTransport:
    """KvTransport over one Redis URL (`redis://host:port/db`)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = redact_url(url)  # only ever shown, never used to connect
        self.client = connect_redis(url, timeout_s)

    async def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if items:
            await self._pipeline("SET", lambda pipe: [pipe.set(k, v) for k, v in items])

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return await self._pipeline("GET", lambda pipe: [pipe.get(k) for k in keys])

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        counts = await self._pipeline("EXISTS", lambda pipe: [pipe.exists(k) for k in keys])
        return [bool(c) for c in counts]

    async def delete_many(self, keys: Sequence[str]) -> None:
        if keys:
            await self._pipeline("DEL", lambda pipe: [pipe.delete(k) for k in keys])

    async def ping(self) -> None:
        await self._call("PING", self.client.ping)

    async def close(self) -> None:
        await self.client.aclose()

    async def _pipeline(self, what: str, queue: Callable[[Pipeline], object]) -> list:
        async def run() -> list:
            async with self.client.pipeline(transaction=False) as pipe:
                queue(pipe)
                return await pipe.execute()

        return await self._call(what, run)

    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call_redis(what, self.url, op)
        except KvStoreUnavailable:
            # Every idle pooled connection is as dead as this one: drop them all, so the first call
            # after Redis returns works instead of tripping over the stale ones one by one.
            await self.client.connection_pool.disconnect()
            raise

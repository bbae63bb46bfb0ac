"""KvStore over a real redis-server: round trips, misses, corruption, and a Redis that goes away."""

import time
import uuid

import pytest
import torch

from ferry.kvstore import KvStore, KvStoreUnavailable, RedisTransport, block_key
from ferry.protocol import hash_full_blocks

pytestmark = pytest.mark.integration

BLOCK_SHAPE = (4, 2, 16, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]


def chain(n, seed=0):
    return hash_full_blocks([seed * 7919 + i for i in range(16 * n)], 16)


def blocks(n, dtype=torch.float32):
    return torch.randn((n, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(n)).to(dtype)


@pytest.fixture
async def store(redis_url, redis):
    transport = RedisTransport(redis_url)
    yield KvStore(transport, f"test-{uuid.uuid4().hex[:8]}:bf16")
    await transport.close()


async def test_blocks_round_trip_through_redis(store, redis):
    hashes, data = chain(8), blocks(8, torch.bfloat16)
    await store.put_blocks(hashes, data)
    got = await store.get_blocks(hashes, dtype=torch.bfloat16, block_shape=BLOCK_SHAPE)
    assert torch.equal(got.view(torch.uint8), data.view(torch.uint8))
    assert await redis.exists(block_key(store.namespace, hashes[0])) == 1
    assert await store.lookup(hashes + chain(2, seed=5)) == 8


async def test_missing_block_is_a_miss_and_lookup_stops_at_the_gap(store, redis):
    hashes = chain(6)
    await store.put_blocks(hashes, blocks(6))
    await redis.delete(block_key(store.namespace, hashes[2]))
    assert await store.get_blocks(hashes) is None
    assert await store.lookup(hashes) == 2
    assert torch.equal(await store.get_blocks(hashes[:2]), blocks(6)[:2])


@pytest.mark.parametrize("damage", ["bit_flip", "truncate"])
async def test_damaged_block_in_redis_is_a_miss_never_loaded(store, redis, damage):
    hashes = chain(3)
    await store.put_blocks(hashes, blocks(3))
    key = block_key(store.namespace, hashes[1])
    if damage == "bit_flip":
        value = bytearray(await redis.get(key))
        value[len(value) // 2] ^= 0x10
        await redis.set(key, bytes(value))
    else:
        await redis.set(key, (await redis.get(key))[:-7])
    assert await store.get_blocks(hashes) is None
    assert store.stats().num_corrupt_blocks == 1
    assert await redis.exists(key) == 0  # deleted, so lookups stop counting it


async def test_another_models_blocks_are_invisible(store):
    hashes = chain(2)
    await store.put_blocks(hashes, blocks(2))
    other = KvStore(store.transport, store.namespace + "-other")
    assert await other.lookup(hashes) == 0 and await other.get_blocks(hashes) is None


async def test_unreachable_redis_fails_fast_with_kv_store_unavailable():
    transport = RedisTransport("redis://:hunter2@127.0.0.1:1/0", timeout_s=0.5)
    store = KvStore(transport, "ns")
    start = time.monotonic()
    for call in (store.lookup(chain(1)), store.get_blocks(chain(1)), store.put_blocks(chain(1), blocks(1))):
        with pytest.raises(KvStoreUnavailable, match="unreachable") as caught:
            await call
        assert "hunter2" not in str(caught.value)  # errors reach logs and replies: no password in them
    assert time.monotonic() - start < 5  # no reconnect loop: a caller can fall back to recompute
    await transport.close()

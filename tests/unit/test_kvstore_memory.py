"""KvStore over the in-process memory transport: the store's logic without a server."""

import pytest
import torch

from ferry.kvstore import KvStore, MemoryTransport, block_key, encode_block
from ferry.protocol import hash_full_blocks

pytestmark = pytest.mark.unit

NS = "tiny:float32:kv1:0001"
BLOCK_SHAPE = (2, 2, 16, 2, 4)  # [layers, K/V, block_size, kv_heads, head_dim]


def chain(n, seed=0):
    return hash_full_blocks([seed * 1000 + i for i in range(16 * n)], 16)


def blocks(n):
    return torch.randn((n, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(n))  # [n, *block_shape]


async def test_put_then_get_returns_the_same_blocks():
    store = KvStore(MemoryTransport(), NS)
    hashes, data = chain(4), blocks(4)
    await store.put_blocks(hashes, data)
    got = await store.get_blocks(hashes, dtype=torch.float32, block_shape=BLOCK_SHAPE)
    assert torch.equal(got, data)
    assert torch.equal(await store.get_blocks(hashes[1:3]), data[1:3])
    stats = store.stats()
    assert (stats.num_blocks_put, stats.num_blocks_got, stats.num_get_misses) == (4, 6, 0)


async def test_any_absent_block_is_a_miss_and_lookup_counts_leading_blocks():
    store = KvStore(MemoryTransport(), NS)
    hashes = chain(5)
    await store.put_blocks(hashes[:3], blocks(3))
    assert await store.get_blocks(hashes) is None
    assert await store.lookup(hashes) == 3
    assert await store.lookup(hashes[1:]) == 2
    assert await store.lookup(chain(2, seed=9)) == 0
    assert store.stats().num_get_misses == 1
    assert store.stats().lookup_hit_rate == pytest.approx(5 / 11)


async def test_namespaces_do_not_see_each_others_blocks():
    transport = MemoryTransport()
    hashes = chain(2)
    await KvStore(transport, NS).put_blocks(hashes, blocks(2))
    other = KvStore(transport, "other-model")
    assert await other.lookup(hashes) == 0
    assert await other.get_blocks(hashes) is None


async def test_a_corrupt_block_is_a_miss_and_is_deleted():
    transport = MemoryTransport()
    store = KvStore(transport, NS)
    hashes = chain(3)
    await store.put_blocks(hashes, blocks(3))
    key = block_key(NS, hashes[1])
    damaged = bytearray((await transport.get_many([key]))[0])
    damaged[-1] ^= 0xFF
    await transport.set_many([(key, bytes(damaged))])
    assert await store.get_blocks(hashes) is None
    assert store.stats().num_corrupt_blocks == 1
    assert await store.lookup(hashes) == 1


async def test_a_value_under_the_wrong_key_is_a_miss():
    transport = MemoryTransport()
    store = KvStore(transport, NS)
    hashes = chain(2)
    await store.put_blocks(hashes, blocks(2))
    first, _ = await transport.get_many(store.keys(hashes))
    await transport.set_many([(block_key(NS, hashes[1]), first)])  # intact, checksummed, but block 0's
    assert await store.get_blocks(hashes) is None
    assert torch.equal(await store.get_blocks(hashes[:1]), blocks(2)[:1])


async def test_a_block_of_another_shape_is_a_miss_but_kept():
    store = KvStore(MemoryTransport(), NS)
    hashes = chain(2)
    await store.put_blocks(hashes, blocks(2))
    assert await store.get_blocks(hashes, block_shape=(2, 2, 16, 2, 8)) is None
    assert await store.get_blocks(hashes, dtype=torch.float16) is None
    assert await store.lookup(hashes) == 2 and store.stats().num_corrupt_blocks == 0


async def test_bad_arguments_are_value_errors():
    store = KvStore(MemoryTransport(), NS)
    with pytest.raises(ValueError, match="expected \\[2"):
        await store.put_blocks(chain(2), blocks(3))
    with pytest.raises(ValueError, match="16"):
        await store.lookup([b"short"])
    with pytest.raises(ValueError, match="namespace"):
        KvStore(MemoryTransport(), "")


async def test_memory_transport_evicts_least_recently_used_past_max_bytes():
    one_block = len(encode_block(blocks(1)[0], NS))
    transport = MemoryTransport(max_bytes=3 * one_block)
    store = KvStore(transport, NS)
    hashes = chain(4)
    await store.put_blocks(hashes[:3], blocks(3))
    await store.get_blocks(hashes[:1])  # touch block 0: block 1 is now the oldest
    await store.put_blocks(hashes[3:], blocks(1))
    assert transport.num_evictions == 1
    assert [await store.lookup([h]) for h in hashes] == [1, 0, 1, 1]

"""Shared-memory transport: blocks written by one process are read by another on the same host."""

import subprocess
import sys

import pytest
import torch

from ferry.kvstore import KvStore, KvStoreUnavailable, ShmTransport
from ferry.protocol import hash_full_blocks

pytestmark = pytest.mark.unit

NS = "llama:float32:kv1:shm/with:odd*chars"
BLOCK_SHAPE = (2, 2, 16, 2, 4)

WRITER = """
import asyncio, sys, torch
from ferry.kvstore import KvStore, ShmTransport
from ferry.protocol import hash_full_blocks
store = KvStore(ShmTransport(sys.argv[1]), sys.argv[2])
data = torch.arange(3 * 512, dtype=torch.float32).reshape(3, 2, 2, 16, 2, 4)
asyncio.run(store.put_blocks(hash_full_blocks(list(range(48)), 16), data))
"""


async def test_blocks_round_trip_and_namespaces_stay_apart(tmp_path):
    transport = ShmTransport(tmp_path / "kv")
    store = KvStore(transport, NS)
    hashes = hash_full_blocks(list(range(64)), 16)
    data = torch.randn((4, *BLOCK_SHAPE))  # [n, *block_shape]
    await store.put_blocks(hashes[:3], data[:3])
    assert torch.equal(await store.get_blocks(hashes[:3]), data[:3])
    assert await store.lookup(hashes) == 3 and await store.get_blocks(hashes) is None
    assert await KvStore(transport, "other").lookup(hashes) == 0
    await transport.delete_many(store.keys(hashes[1:2]))
    assert await store.lookup(hashes) == 1
    assert not list((tmp_path / "kv").glob(".tmp-*"))  # no half-written files left behind


async def test_another_process_reads_what_one_process_wrote(tmp_path):
    root = tmp_path / "shared"
    subprocess.run([sys.executable, "-c", WRITER, str(root), NS], check=True, timeout=120)
    store = KvStore(ShmTransport(root), NS)
    got = await store.get_blocks(hash_full_blocks(list(range(48)), 16), dtype=torch.float32)
    assert torch.equal(got, torch.arange(3 * 512, dtype=torch.float32).reshape(3, *BLOCK_SHAPE))


async def test_a_vanished_folder_is_unavailable_not_a_crash(tmp_path):
    transport = ShmTransport(tmp_path / "kv")
    transport.clear()
    with pytest.raises(KvStoreUnavailable):
        await KvStore(transport, NS).put_blocks(hash_full_blocks(list(range(16)), 16), torch.zeros(1, 4))

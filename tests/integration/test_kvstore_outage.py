"""A Redis that stops mid-run: store calls raise KvStoreUnavailable, and work again once it returns."""

import signal
import time

import pytest
import torch

from ferry.kvstore import KvStore, KvStoreUnavailable, RedisTransport
from ferry.launcher.servers import start_redis
from ferry.protocol import hash_full_blocks

pytestmark = pytest.mark.integration


async def test_store_fails_fast_while_redis_is_down_and_recovers():
    server = start_redis()
    transport = RedisTransport(server.url, timeout_s=1.0)
    store = KvStore(transport, "outage-ns")
    hashes, data = hash_full_blocks(list(range(64)), 16), torch.ones(4, 2, 16, 8)
    try:
        await store.put_blocks(hashes, data)
        server.stop()
        with pytest.raises(KvStoreUnavailable):
            await store.get_blocks(hashes)
        with pytest.raises(KvStoreUnavailable):
            await store.put_blocks(hashes, data)
        server = start_redis(port=server.port)  # same port, empty (no persistence): the data is gone, the store works
        assert await store.lookup(hashes) == 0
        await store.put_blocks(hashes, data)
        assert torch.equal(await store.get_blocks(hashes), data)
    finally:
        await transport.close()
        server.stop()


async def test_a_hung_redis_times_out_and_later_replies_never_land_on_other_requests():
    server = start_redis()
    transport = RedisTransport(server.url, timeout_s=0.5)
    store = KvStore(transport, "hung-ns")
    first, second = hash_full_blocks(list(range(32)), 16)
    try:
        await store.put_blocks([first, second], torch.stack([torch.zeros(2, 16, 8), torch.ones(2, 16, 8)]))
        server.process.send_signal(signal.SIGSTOP)  # alive but silent: no RST, only the timeout helps
        start = time.monotonic()
        with pytest.raises(KvStoreUnavailable):
            await store.get_blocks([first])
        assert time.monotonic() - start < 3
        server.process.send_signal(signal.SIGCONT)  # the stale reply for `first` now arrives
        got = await store.get_blocks([second])
        assert got is not None and torch.equal(got[0], torch.ones(2, 16, 8))
    finally:
        server.process.send_signal(signal.SIGCONT)
        await transport.close()
        server.stop()

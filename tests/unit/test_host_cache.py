"""The host tier's block cache: bounded LRU of evicted blocks, net change events."""

from __future__ import annotations

import pytest
import torch

from ferry.engine.host_cache import HostBlockCache

pytestmark = pytest.mark.unit


def block(value: float) -> torch.Tensor:
    return torch.full((2, 3), value)


def test_keeps_the_most_recently_used_blocks_up_to_its_capacity():
    cache = HostBlockCache(2)
    cache.put(b"a", block(1))
    cache.put(b"b", block(2))
    assert cache.get(b"a") is not None  # a is now the most recent: b goes first
    cache.put(b"c", block(3))
    assert (b"a" in cache, b"b" in cache, b"c" in cache) == (True, False, True)
    assert torch.equal(cache.get(b"c"), block(3))
    assert cache.num_dropped == 1 and len(cache) == 2


def test_keeps_its_own_copy_on_the_host():
    source = block(1)
    cache = HostBlockCache(4)
    cache.put(b"a", source)
    source.fill_(9)
    assert torch.equal(cache.get(b"a"), block(1))


def test_counts_leading_blocks_from_a_start():
    cache = HostBlockCache(8)
    for h in (b"b", b"c", b"e"):
        cache.put(h, block(0))
    chain = [b"a", b"b", b"c", b"d", b"e"]
    assert cache.num_leading(chain) == 0
    assert cache.num_leading(chain, 1) == 2
    assert cache.num_leading(chain, 4) == 1
    assert cache.num_leading(chain, 5) == 0


def test_events_are_net_changes_since_the_last_drain():
    cache = HostBlockCache(1)
    cache.put(b"a", block(0))
    cache.put(b"b", block(0))  # a dropped before anyone heard of it: never reported
    assert cache.drain_events() == ([b"b"], [])
    cache.put(b"c", block(0))
    assert cache.drain_events() == ([b"c"], [b"b"])
    cache.discard(b"c")
    cache.put(b"c", block(0))  # gone and back between two drains: nothing to say
    assert cache.drain_events() == ([], [])


def test_capacity_zero_keeps_nothing_and_bad_capacity_is_refused():
    cache = HostBlockCache(0)
    cache.put(b"a", block(0))
    assert len(cache) == 0 and cache.drain_events() == ([], [])
    with pytest.raises(ValueError, match="capacity_blocks"):
        HostBlockCache(-1)

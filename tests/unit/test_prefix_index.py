"""The prefill-balancer's prefix index: what pools and the store hold, bounded, weighted."""

from __future__ import annotations

import pytest

from ferry.protocol import hash_full_blocks
from ferry_services.prefill_balancer.prefix_index import STORE, PrefixIndex, PrefixIndexConfig

pytestmark = pytest.mark.unit

HASHES = hash_full_blocks(list(range(80)), 16)  # 5 chained blocks


def test_leading_counts_only_the_unbroken_chain():
    index = PrefixIndex()
    index.apply("stored", "ns", "w1", [HASHES[0], HASHES[1], HASHES[3]])
    assert index.leading("ns", "w1", HASHES) == 2
    assert index.leading("other-ns", "w1", HASHES) == 0
    index.apply("removed", "ns", "w1", [HASHES[0]])
    assert index.leading("ns", "w1", HASHES) == 0


def test_pool_blocks_weigh_more_than_store_blocks():
    index = PrefixIndex(PrefixIndexConfig(remote_weight=0.5))
    index.apply("stored", "ns", "w1", HASHES[:2])
    index.apply("stored", "ns", STORE, HASHES[:4])
    cached = index.cached_tokens({"w1": "ns", "w2": "ns"}, HASHES, 16)
    assert cached == {"w1": (2 + 0.5 * 2) * 16, "w2": int(0.5 * 4 * 16)}


def test_each_block_is_credited_by_the_fastest_tier_holding_it():
    index = PrefixIndex()  # device 1.0, host 0.75, remote 0.25
    index.apply("stored", "ns", "w1", HASHES[:1])
    index.apply("stored", "ns", "w1", HASHES[1:3], tier="host")
    index.apply("stored", "ns", STORE, HASHES[:4], tier="remote")
    index.apply("stored", "ns", "w2", HASHES[:4], tier="host")
    assert index.tier_credits("ns", "w1", HASHES) == [1.0, 0.75, 0.75, 0.25]
    assert index.tier_credits("ns", "w2", HASHES) == [0.75] * 4
    assert index.cached_tokens({"w1": "ns", "w2": "ns", "w3": "ns"}, HASHES, 16) == {"w1": 44, "w2": 48, "w3": 16}
    assert index.leading("ns", "w1", HASHES) == 1  # the device tier alone
    assert index.leading("ns", "w1", HASHES[1:], tier="host") == 2
    index.apply("removed", "ns", "w1", HASHES[1:2], tier="host")
    assert index.tier_credits("ns", "w1", HASHES) == [1.0, 0.25, 0.75, 0.25]
    index.forget("w1")  # every tier of a worker that left
    assert index.tier_credits("ns", "w1", HASHES) == [0.25] * 4


def test_tier_weights_are_configurable_and_checked():
    index = PrefixIndex(PrefixIndexConfig(device_weight=1.0, host_weight=0.5, remote_weight=0.0))
    index.apply("stored", "ns", "w1", HASHES[:2], tier="host")
    index.apply("stored", "ns", STORE, HASHES)
    assert index.tier_credits("ns", "w1", HASHES) == [0.5, 0.5, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="host_weight"):
        PrefixIndexConfig(host_weight=1.5)


def test_cleared_and_forget_drop_a_location():
    index = PrefixIndex()
    index.apply("stored", "ns", STORE, HASHES)
    index.apply("stored", "ns", "w1", HASHES)
    index.apply("cleared", "ns", STORE)
    index.forget("w1")
    assert index.leading("ns", STORE, HASHES) == index.leading("ns", "w1", HASHES) == 0


def test_bounded_per_location_and_in_locations():
    index = PrefixIndex(PrefixIndexConfig(max_blocks_per_location=3, max_locations=2))
    index.apply("stored", "ns", "w1", HASHES)
    assert index.num_blocks("ns", "w1") == 3  # the most recently touched three
    assert index.leading("ns", "w1", HASHES[2:]) == 3
    index.apply("stored", "ns", "w2", HASHES[:1])
    index.apply("stored", "ns", "w3", HASHES[:1])
    assert index.num_blocks("ns", "w1") == 0 and index.num_blocks("ns", "w3") == 1


def test_bad_kind_and_config_name_the_field():
    with pytest.raises(ValueError, match="kind"):
        PrefixIndex().apply("moved", "ns", "w1")
    with pytest.raises(ValueError, match="remote_weight"):
        PrefixIndexConfig(remote_weight=2)


def test_only_in_store_lists_the_blocks_a_prefetch_would_bring():
    index = PrefixIndex()
    index.apply("stored", "ns", "w1", HASHES[:1])
    index.apply("stored", "ns", "w1", HASHES[2:3], tier="host")
    index.apply("stored", "ns", STORE, HASHES[:4])
    assert index.only_in_store("ns", "w1", HASHES) == [HASHES[1], HASHES[3]]  # the chain ends at block 4
    assert index.only_in_store("ns", "w2", HASHES) == HASHES[:4]
    assert index.only_in_store("other", "w1", HASHES) == []


def test_not_held_lists_what_a_warm_up_fetches_whatever_the_store_says():
    index = PrefixIndex()
    index.apply("stored", "ns", "w1", HASHES[:2])
    index.apply("stored", "ns", "w1", HASHES[3:4], tier="host")
    # the sender vouches for the store: no 'remote' event is needed, and the chain does not end
    assert index.not_held("ns", "w1", HASHES) == [HASHES[2], HASHES[4]]
    assert index.not_held("ns", "w2", HASHES[:3]) == HASHES[:3]

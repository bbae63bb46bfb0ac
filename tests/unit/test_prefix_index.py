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
    index = PrefixIndex(PrefixIndexConfig(store_weight=0.5))
    index.apply("stored", "ns", "w1", HASHES[:2])
    index.apply("stored", "ns", STORE, HASHES[:4])
    cached = index.cached_tokens({"w1": "ns", "w2": "ns"}, HASHES, 16)
    assert cached == {"w1": (2 + 0.5 * 2) * 16, "w2": int(0.5 * 4 * 16)}


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
    with pytest.raises(ValueError, match="store_weight"):
        PrefixIndexConfig(store_weight=2)

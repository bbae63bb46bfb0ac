"""The kvcache service's block index: counts, and the events it produces from changes and rescans."""

import pytest

from ferry.kvstore.index import MAX_HASHES_PER_EVENT, BlockIndex

pytestmark = pytest.mark.unit


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def kinds(changes):
    return [(c.kind, c.namespace, c.block_hashes) for c in changes]


def test_stored_and_removed_blocks_are_counted_and_become_events_once():
    index = BlockIndex()
    index.stored("a", h(1), 100)
    index.stored("a", h(2), 100)
    index.stored("a", h(2), 120)  # rewritten: size changes, no second event
    index.stored("b", h(1), 50)
    assert (index.num_blocks(), index.num_bytes(), index.num_bytes("a")) == (3, 270, 220)
    assert kinds(index.drain_changes()) == [("stored", "a", [h(1), h(2)]), ("stored", "b", [h(1)])]
    index.removed("a", h(1))
    index.removed("a", h(9))  # never seen: nothing to say
    assert kinds(index.drain_changes()) == [("removed", "a", [h(1)])]
    assert index.drain_changes() == []
    assert index.blocks_per_namespace() == {"a": 1, "b": 1}


def test_resync_publishes_the_difference_and_clears_vanished_namespaces():
    index = BlockIndex()
    for i in range(3):
        index.stored("a", h(i), 10)
    index.stored("b", h(7), 10)
    index.drain_changes()
    index.resync({"a": {h(1): 10, h(2): 10, h(5): 10}, "c": {h(8): 10}})
    assert kinds(index.drain_changes()) == [
        ("cleared", "b", []),
        ("removed", "a", [h(0)]),
        ("stored", "a", [h(5)]),
        ("stored", "c", [h(8)]),
    ]
    assert index.blocks_per_namespace() == {"a": 3, "c": 1}


def test_big_bursts_are_split_into_bounded_events():
    index = BlockIndex()
    for i in range(MAX_HASHES_PER_EVENT + 5):
        index.stored("a", h(i), 1)
    sizes = [len(c.block_hashes) for c in index.drain_changes()]
    assert sizes == [MAX_HASHES_PER_EVENT, 5]

"""Block manager: reference counts, prefix reuse, pending prefixes, LRU eviction, events."""

import pytest

from ferry.engine.block_manager import BlockManager
from ferry.engine.sequence import Sequence
from ferry.protocol import SamplingParams, hash_full_blocks

pytestmark = pytest.mark.unit
BS = 4


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams())


def admit(bm, seq):
    match = bm.match_prefix(seq)
    assert bm.allocate(seq, match)
    return match


def finish_prefill(bm, seq):
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_allocate_and_free_counts():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    admit(bm, seq)
    assert len(seq.block_ids) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []


def test_full_blocks_are_reused_and_ref_counted():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(12)) + [100, 101], "a")
    admit(bm, a)
    finish_prefill(bm, a)
    b = make_seq(list(range(12)) + [200], "b")
    match = admit(bm, b)
    assert match.block_ids == a.block_ids[:3]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert all(bm.ref_count(x) == 2 for x in a.block_ids[:3])
    assert bm.num_used_blocks == 4 + 1


def test_hashes_match_the_protocol_chain():
    bm = BlockManager(16, BS)
    tokens = list(range(13))
    a = make_seq(tokens)
    admit(bm, a)
    finish_prefill(bm, a)
    stored, removed = bm.drain_events()
    assert stored == hash_full_blocks(tokens, BS) and removed == []


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(16, BS)
    a = make_seq(range(8), "a")
    admit(bm, a)
    finish_prefill(bm, a)
    b = make_seq(range(8), "b")
    assert admit(bm, b).block_ids == a.block_ids[:1]
    assert b.num_computed_tokens == 4


def test_prefix_being_computed_is_pending():
    bm = BlockManager(16, BS)
    a = make_seq(range(9), "a")
    admit(bm, a)
    b = make_seq(range(9), "b")
    assert bm.match_prefix(b).is_pending
    finish_prefill(bm, a)
    match = bm.match_prefix(b)
    assert not match.is_pending and len(match.block_ids) == 2


def test_pending_name_is_forgotten_when_owner_leaves_uncomputed():
    bm = BlockManager(16, BS)
    a = make_seq(range(9), "a")
    admit(bm, a)
    bm.free(a)
    match = bm.match_prefix(make_seq(range(9), "b"))
    assert match.block_ids == [] and not match.is_pending
    assert bm.drain_events() == ([], [])


def test_freed_cached_blocks_survive_until_evicted_lru():
    bm = BlockManager(4, BS)
    a = make_seq(range(8), "a")  # 2 blocks
    admit(bm, a)
    finish_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    c = make_seq(range(100, 108), "c")  # takes the 2 never-used blocks first
    admit(bm, c)
    assert bm.num_cached_blocks == 2
    bm.drain_events()
    d = make_seq(range(200, 204), "d")  # must evict; a's tail block goes before its head
    admit(bm, d)
    _, removed = bm.drain_events()
    assert removed == [hash_full_blocks(list(range(8)), BS)[1]]
    e = make_seq(list(range(4)) + [7], "e")
    assert len(bm.match_prefix(e).block_ids) == 1  # head survived


def test_allocate_fails_cleanly_when_short():
    bm = BlockManager(3, BS)
    a = make_seq(range(8), "a")
    admit(bm, a)
    b = make_seq(range(100, 108), "b")
    assert not bm.allocate(b, bm.match_prefix(b))
    assert b.block_ids == [] and bm.num_free_blocks == 1


def test_append_slots_grows_on_block_boundary():
    bm = BlockManager(4, BS)
    a = make_seq(range(4))
    admit(bm, a)
    finish_prefill(bm, a)
    a.token_ids.append(9)
    assert bm.append_slots(a, 1) and len(a.block_ids) == 2
    assert bm.append_slots(a, 1) and len(a.block_ids) == 2
    assert not bm.append_slots(a, 16)


def test_decoded_blocks_enter_the_cache():
    bm = BlockManager(8, BS)
    a = make_seq(range(3))
    admit(bm, a)
    finish_prefill(bm, a)
    a.token_ids += [5, 6]  # 5 tokens, 4 computed after the next decode
    bm.append_slots(a, 1)
    a.num_computed_tokens += 1
    bm.commit(a)
    stored, _ = bm.drain_events()
    assert stored == hash_full_blocks([0, 1, 2, 5], BS)


def test_disabled_prefix_caching_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(range(9), "a")
    admit(bm, a)
    finish_prefill(bm, a)
    assert bm.match_prefix(make_seq(range(9), "b")).block_ids == []
    assert bm.drain_events() == ([], [])


def test_events_are_net_changes_and_stay_bounded_when_nobody_drains():
    """A decode-only engine never drains: churning many prompts through a small pool must not grow
    the event state, and a later drain reports only what is cached now."""
    bm = BlockManager(4, BS)
    for i in range(200):
        seq = make_seq(range(i * 8, i * 8 + 8), f"s{i}")
        admit(bm, seq)
        finish_prefill(bm, seq)
        bm.free(seq)
    assert len(bm._pending) <= 4 and not bm._announced
    stored, removed = bm.drain_events()
    assert set(stored) == set(hash_full_blocks(list(range(199 * 8, 200 * 8)), BS)) | set(
        hash_full_blocks(list(range(198 * 8, 199 * 8)), BS)
    )
    assert removed == []
    # once announced, an eviction is reported as removed
    seq = make_seq(range(10_000, 10_016), "big")
    admit(bm, seq)
    _, removed = bm.drain_events()
    assert set(removed) == set(stored)

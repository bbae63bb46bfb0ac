"""Partial last blocks in the block manager: named when their sequence frees them, found by a prompt
that extends their tokens, and copied (never shared) into the new sequence's own block."""

import pytest

from ferry.engine.block_manager import BlockManager
from ferry.engine.partial_blocks import tail_keys
from ferry.engine.sequence import Sequence
from ferry.protocol import SamplingParams, hash_full_blocks, hash_partial_block

pytestmark = pytest.mark.unit
BS = 4


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams())


def run_and_free(bm, tokens, rid="a", computed=None):
    """Admit `tokens`, compute all but the last (a finished sequence), free it."""
    seq = make_seq(tokens, rid)
    assert bm.allocate(seq, bm.match_prefix(seq))
    seq.num_computed_tokens = computed if computed is not None else len(tokens) - 1
    bm.commit(seq)
    held = list(seq.block_ids)
    bm.free(seq)
    return held


def copying_manager(num_blocks=16):
    bm = BlockManager(num_blocks, BS)
    copies = []
    bm.on_copy = lambda src, dst: copies.append((src, dst))
    return bm, copies


def test_a_freed_partial_block_is_named_and_found_by_a_prompt_that_extends_it():
    bm, copies = copying_manager()
    first = list(range(10, 21))  # 11 tokens, 10 computed: blocks [10..13] [14..17] and 2 of [18, 19]
    held = run_and_free(bm, first)
    key = hash_partial_block(hash_full_blocks(first, BS)[1], [18, 19])
    assert bm.num_leading_cached([key]) == 1
    stored, _ = bm.drain_events()
    assert key in stored

    nxt = make_seq(first + [50, 51, 52], "b")  # re-sends 20 (never computed) and adds a message
    match = bm.match_prefix(nxt)
    assert match.block_ids == held[:2] and match.tail == (held[2], 2)
    assert bm.allocate(nxt, match)
    assert copies == [(held[2], nxt.block_ids[2])] and nxt.block_ids[2] != held[2]  # copy-on-write
    assert nxt.num_computed_tokens == nxt.num_cached_tokens == 10
    assert bm.num_tail_hit_tokens == 2 and bm.num_hit_tokens == 10
    assert bm.ref_count(held[2]) == 0 and bm.num_leading_cached([key]) == 1  # still cached for others


def test_the_longest_partial_that_leaves_a_token_to_compute_is_used():
    bm, _ = copying_manager()
    run_and_free(bm, list(range(7)), "a", computed=7)  # 1 full block + 3 tokens
    run_and_free(bm, list(range(6)), "b", computed=6)  # same first block + 2 tokens
    longer = bm.match_prefix(make_seq(list(range(7)) + [99], "c"))
    assert longer.tail is not None and longer.tail[1] == 3
    exact = bm.match_prefix(make_seq(list(range(7)), "d"))  # 3 would leave nothing to compute
    assert exact.tail is not None and exact.tail[1] == 2


def test_other_tokens_or_another_prefix_do_not_match():
    bm, _ = copying_manager()
    run_and_free(bm, list(range(11)))
    assert bm.match_prefix(make_seq(list(range(8)) + [7, 9, 10, 11], "b")).tail is None  # 8 differs
    assert bm.match_prefix(make_seq([1] + list(range(1, 11)) + [5], "c")).tail is None  # first block differs


def test_without_a_copy_function_a_partial_is_never_matched():
    bm = BlockManager(16, BS)
    run_and_free(bm, list(range(11)))
    seq = make_seq(list(range(11)) + [1, 2], "b")
    match = bm.match_prefix(seq)
    assert match.tail is None
    assert bm.allocate(seq, match) and seq.num_computed_tokens == 8


def test_the_partial_block_is_not_handed_out_as_a_fresh_block_before_it_is_copied():
    bm, copies = copying_manager(num_blocks=3)  # one full block and a partial one; 1 slot left
    held = run_and_free(bm, list(range(7)), computed=6)
    seq = make_seq(list(range(7)) + [40, 41], "b")  # needs 3 blocks: the full hit, 2 fresh
    match = bm.match_prefix(seq)
    assert match.tail == (held[1], 2)
    assert bm.num_blocks_taken(seq, match) == 4 > bm.num_free_blocks  # the partial is held while taking
    assert not bm.allocate(seq, match) and copies == []
    seq2 = make_seq(list(range(7)) + [40], "c")  # 2 blocks: fits with the partial held
    match2 = bm.match_prefix(seq2)
    assert bm.allocate(seq2, match2)
    src, dst = copies[0]
    assert src == held[1] and dst not in (held[0], held[1])


def test_a_shared_or_unfinished_block_is_not_named():
    bm, _ = copying_manager()
    a = make_seq(list(range(10)), "a")
    b = make_seq(list(range(10)), "b")
    assert bm.allocate(a, bm.match_prefix(a))
    a.num_computed_tokens = 9
    bm.commit(a)
    assert bm.allocate(b, bm.match_prefix(b))  # shares a's full blocks only
    bm.free(a)  # a's partial block is its own: named
    assert bm.match_prefix(make_seq(list(range(10)) + [3], "c")).tail is not None
    zero = make_seq(list(range(8)) + [1], "z")
    assert bm.allocate(zero, bm.match_prefix(zero))
    bm.free(zero)  # nothing computed past the cached blocks: no partial
    assert bm.match_prefix(make_seq(list(range(8)) + [1, 2], "y")).tail is None


def test_tail_keys_leave_one_token_and_chain_on_the_full_blocks():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, BS)
    keys = list(tail_keys(tokens, hashes, 2, BS))
    assert [n for n, _ in keys] == [1]  # 10 tokens, 8 in full blocks, 1 must stay to compute
    assert keys[0][1] == hash_partial_block(hashes[1], [8])
    assert [n for n, _ in tail_keys(tokens, hashes, 1, BS)] == [3, 2, 1]
    assert next(tail_keys(tokens, [], 0, BS))[1] == hash_partial_block(None, [0, 1, 2])

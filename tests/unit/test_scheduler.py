"""Scheduler: decodes first, chunked prefill, admission limits, preemption, static mode."""

import pytest

from ferry.engine.block_manager import BlockManager
from ferry.engine.scheduler import Scheduler
from ferry.engine.sequence import SeqStatus, Sequence
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit
BS = 4


def make_seq(n, rid, start=0):
    return Sequence(rid, list(range(start, start + n)), n, SamplingParams())


def make_sched(num_blocks=64, max_seqs=8, budget=32, static=False, prefix=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(bm, max_seqs, budget, static_batching=static)


def step(sched, token=7):
    """One engine step without a model: compute, then sample a token where the prompt is done."""
    batch = sched.schedule()
    sched.update(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)
    return batch


def plan(batch):
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched = make_sched(budget=16)
    sched.add(make_seq(5, "short", start=1000))
    sched.add(make_seq(40, "long"))
    assert plan(step(sched)) == [("short", 5), ("long", 11)]
    assert plan(step(sched)) == [("short", 1), ("long", 15)]
    assert plan(step(sched)) == [("short", 1), ("long", 14)]
    assert plan(step(sched)) == [("short", 1), ("long", 1)]


def test_running_cap_bounds_admission():
    sched = make_sched(max_seqs=2)
    for i in range(3):
        sched.add(make_seq(3, f"r{i}", start=100 * i))
    batch = step(sched)
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"]
    assert len(sched.waiting) == 1
    sched.remove(sched.running[0])
    assert [s.request_id for s in step(sched).seqs] == ["r1", "r2"]


def test_finished_sequence_frees_blocks_at_once():
    sched = make_sched()
    seq = make_seq(9, "a")
    sched.add(seq)
    step(sched)
    assert sched.block_manager.num_used_blocks == 3
    sched.remove(seq)
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()
    assert seq.status is SeqStatus.FINISHED


def test_admission_waits_for_free_blocks_fcfs():
    sched = make_sched(num_blocks=4, prefix=False)
    sched.add(make_seq(12, "big"))  # 3 blocks
    sched.add(make_seq(8, "next", start=100))  # 2 blocks: does not fit
    sched.add(make_seq(2, "small", start=200))  # would fit, but must not overtake
    assert [s.request_id for s in step(sched).seqs] == ["big"]
    assert [s.request_id for s in sched.waiting] == ["next", "small"]


def test_pool_exhaustion_preempts_newest_and_everyone_finishes():
    sched = make_sched(num_blocks=6, budget=64, prefix=False)
    seqs = [make_seq(7, f"r{i}", start=100 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    preempted = 0
    for _ in range(200):
        batch = step(sched)
        preempted += batch.num_preempted
        assert sched.block_manager.num_used_blocks <= 6
        for seq in list(sched.running):
            if seq.num_output_tokens >= 10:
                sched.remove(seq)
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert preempted > 0
    assert seqs[0].num_preemptions == 0  # the oldest is never the victim while others run
    assert all(s.num_output_tokens >= 10 for s in seqs)


def test_preempted_sequence_is_recomputed_from_all_its_tokens():
    sched = make_sched(num_blocks=3, budget=64, prefix=False)
    a, b = make_seq(4, "a"), make_seq(4, "b", start=50)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 1 block each, 5 tokens each now
    batch = step(sched)  # a takes the last block, b needs one and is preempted
    assert plan(batch) == [("a", 1)] and batch.num_preempted == 1
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and sched.waiting[0] is b
    sched.remove(a)
    assert plan(step(sched)) == [("b", 5)]


def test_twin_prompts_compute_shared_prefix_once():
    sched = make_sched(budget=64)
    prefix = list(range(16))
    for i in range(3):
        sched.add(Sequence(f"r{i}", prefix + [100 + i], 17, SamplingParams()))
    first = step(sched)
    assert plan(first) == [("r0", 17)]
    second = step(sched)
    assert plan(second) == [("r0", 1), ("r1", 1), ("r2", 1)]
    assert [s.num_cached_tokens for s in second.seqs[1:]] == [16, 16]


def test_static_batch_admits_only_when_batch_is_done():
    sched = make_sched(max_seqs=2, static=True)
    for i in range(3):
        sched.add(make_seq(3, f"r{i}", start=100 * i))
    assert [s.request_id for s in step(sched).seqs] == ["r0", "r1"]
    sched.remove(sched.running[0])
    assert [s.request_id for s in step(sched).seqs] == ["r1"]  # r2 waits for the batch
    sched.remove(sched.running[0])
    assert [s.request_id for s in step(sched).seqs] == ["r2"]


def test_static_admission_reserves_each_members_full_length():
    # 8 blocks of 4 tokens: prompts of 3 fit many times over, but 3 + max_tokens 9 = 12 tokens = 3 blocks each
    sched = make_sched(num_blocks=8, max_seqs=4, static=True)
    dyn = make_sched(num_blocks=8, max_seqs=4)
    for s in (sched, dyn):
        for i in range(4):
            s.add(Sequence(f"r{i}", list(range(100 * i, 100 * i + 3)), 3, SamplingParams(max_tokens=9)))
    assert [s.request_id for s in step(sched).seqs] == ["r0", "r1"]  # a third would not fit at full length
    assert len(step(dyn).seqs) == 4  # dynamic allocates as tokens come, preempting if it must
    for _ in range(8):  # the static batch decodes to its full length without a preemption
        step(sched)
    assert sched.num_preemptions == 0 and [s.num_tokens for s in sched.running] == [12, 12]


def test_dynamic_refills_a_freed_slot_at_once():
    sched = make_sched(max_seqs=2)
    for i in range(3):
        sched.add(make_seq(3, f"r{i}", start=100 * i))
    step(sched)
    sched.remove(sched.running[0])
    assert plan(step(sched)) == [("r1", 1), ("r2", 3)]


def test_shortest_first_admits_short_prompts_first_and_a_passed_over_one_waits_one_admission_at_most():
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, 8, 16, shortest_first=True)
    sched.add(make_seq(12, "long", start=0))
    sched.add(make_seq(6, "mid", start=100))
    sched.add(make_seq(3, "short", start=200))
    assert plan(step(sched)) == [("short", 3), ("mid", 6), ("long", 7)]  # shortest first, the budget's rest chunked
    sched = Scheduler(BlockManager(64, BS, enable_prefix_caching=False), 8, 8, shortest_first=True)
    sched.add(make_seq(8, "a", start=0))
    sched.add(make_seq(5, "b", start=100))
    sched.add(make_seq(4, "c", start=200))
    assert plan(step(sched)) == [("c", 4), ("b", 4)]  # a passed over
    sched.add(make_seq(2, "d", start=300))  # shorter than a, but a was passed over once: a goes first
    assert plan(step(sched)) == [("c", 1), ("b", 1), ("a", 6)]
    assert plan(step(sched)) == [("c", 1), ("b", 1), ("a", 2), ("d", 2)]


def test_a_split_admission_takes_the_shortest_half_of_the_tokens_and_the_rest_goes_whole_next():
    """split_min_tokens: fresh prompts of 2+3+4+5+10 = 24 tokens wait, the budget (32) holds them all;
    the first step takes the shortest ones up to half the tokens (12: 2+3+4), so three first tokens come
    out of a 9-token step instead of one 24-token step; the two passed over go whole in the next step,
    before a newer, shorter prompt (none waits more than one extra admission), with no split then."""
    sched = Scheduler(BlockManager(64, BS, enable_prefix_caching=False), 8, 32, shortest_first=True, split_min_tokens=4)
    for i, n in enumerate([10, 5, 4, 3, 2]):
        sched.add(make_seq(n, f"p{n}", start=100 * i))
    assert plan(step(sched)) == [("p2", 2), ("p3", 3), ("p4", 4)]
    sched.add(make_seq(1, "late", start=900))
    assert plan(step(sched)) == [("p2", 1), ("p3", 1), ("p4", 1), ("p10", 10), ("p5", 5), ("late", 1)]


def test_a_split_admission_stops_no_lower_than_split_min_tokens_and_never_below_one_prompt():
    sched = Scheduler(BlockManager(64, BS, enable_prefix_caching=False), 8, 32, shortest_first=True, split_min_tokens=8)
    for i, n in enumerate([6, 3, 2]):  # half of 11 is 6 < 8: up to 8 tokens
        sched.add(make_seq(n, f"p{n}", start=100 * i))
    assert plan(step(sched)) == [("p2", 2), ("p3", 3)]
    sched = Scheduler(BlockManager(64, BS, enable_prefix_caching=False), 8, 32, shortest_first=True, split_min_tokens=4)
    sched.add(make_seq(20, "alone", start=0))  # more than half of itself: admitted whole anyway
    assert plan(step(sched)) == [("alone", 20)]


def test_without_split_min_tokens_an_admission_fills_the_budget():
    sched = Scheduler(BlockManager(64, BS, enable_prefix_caching=False), 8, 32, shortest_first=True)
    for i, n in enumerate([10, 5, 4, 3, 2]):
        sched.add(make_seq(n, f"p{n}", start=100 * i))
    assert plan(step(sched)) == [("p2", 2), ("p3", 3), ("p4", 4), ("p5", 5), ("p10", 10)]


def test_fcfs_keeps_arrival_order():
    sched = make_sched(budget=16)
    sched.add(make_seq(12, "long", start=0))
    sched.add(make_seq(3, "short", start=200))
    assert plan(step(sched)) == [("long", 12), ("short", 3)]

"""Decode routing: KV usage and batch fill, the batch cap, free blocks, session affinity."""

import pytest
from test_balancing_view import report

from ferry.balancing.view import WorkerView
from ferry.protocol import HANDOFF_TOO_LONG
from ferry_services.decode_balancer.affinity import SessionAffinity
from ferry_services.decode_balancer.policy import (
    DecodePolicyConfig,
    affinity_credit,
    blocks_needed,
    choose_decode_worker,
)

pytestmark = pytest.mark.unit
CONFIG = DecodePolicyConfig()


def view_of(**workers: dict) -> WorkerView:
    view = WorkerView("decode")
    for worker_id, kw in workers.items():
        view.update(report(worker_id, role="decode", **kw), now=0.0)
    return view


def test_blocks_include_the_next_token_slot():
    assert blocks_needed(15, 16) == 1
    assert blocks_needed(16, 16) == 2
    assert blocks_needed(33, 16) == 3


def test_lower_kv_usage_and_fewer_running_win():
    view = view_of(a=dict(kv_blocks_used=60, num_running=2), b=dict(kv_blocks_used=20, num_running=2))
    choice = choose_decode_worker(view.routable(0.0), 40, CONFIG)
    assert (choice.worker_id, choice.num_blocks) == ("b", 3)
    view = view_of(a=dict(kv_blocks_used=20, num_running=6), b=dict(kv_blocks_used=20, num_running=1))
    assert choose_decode_worker(view.routable(0.0), 40, CONFIG).worker_id == "b"


def test_batch_cap_is_enforced_counting_routed_sequences():
    view = view_of(a=dict(num_running=1, max_running=2), b=dict(num_running=0, max_running=1))
    routed = []
    for _ in range(3):
        choice = choose_decode_worker(view.routable(0.0), 10, CONFIG)
        if choice.worker_id:
            view.note_routed(choice.worker_id, blocks=choice.num_blocks)
        routed.append(choice.worker_id or choice.reason)
    assert sorted(routed[:2]) == ["a", "b"]
    assert routed[2] == "overloaded"


def test_hand_offs_waiting_in_jetstream_count_against_the_batch_cap():
    view = view_of(a=dict(num_running=6, num_backlog=2), b=dict(num_running=7))
    assert choose_decode_worker(view.routable(0.0), 10, CONFIG).worker_id == "b"
    view = view_of(a=dict(num_running=6, num_backlog=2), b=dict(num_running=7, num_backlog=1))
    assert choose_decode_worker(view.routable(0.0), 10, CONFIG).reason == "overloaded"


def test_worker_without_enough_free_blocks_is_skipped():
    view = view_of(a=dict(kv_blocks_used=98), b=dict(kv_blocks_used=50, num_running=7))
    choice = choose_decode_worker(view.routable(0.0), 64, CONFIG)  # needs 5 blocks
    assert choice.worker_id == "b"


def test_block_size_comes_from_each_workers_report():
    view = view_of(a=dict(kv_blocks_used=97, block_size=32), b=dict(kv_blocks_used=97, block_size=16))
    choice = choose_decode_worker(view.routable(0.0), 40, CONFIG)  # a: 2 blocks fit, b: 3 do not
    assert (choice.worker_id, choice.num_blocks) == ("a", 2)


def test_no_workers_and_overloaded():
    assert choose_decode_worker([], 10, CONFIG).reason == "no_workers"
    view = view_of(a=dict(num_running=8))
    choice = choose_decode_worker(view.routable(0.0), 10, CONFIG)
    assert (choice.worker_id, choice.reason, choice.retry_after_s) == (None, "overloaded", 0.5)


def test_a_sequence_no_workers_whole_pool_holds_is_too_long_not_overloaded():
    view = view_of(a=dict(), b=dict(kv_blocks_total=200, kv_blocks_used=150))  # block size 16
    choice = choose_decode_worker(view.routable(0.0), 3200, CONFIG)  # 201 blocks: more than either pool
    assert choice.worker_id is None and choice.reason.startswith(HANDOFF_TOO_LONG)
    assert "201 KV blocks" in choice.reason and "pool has 200" in choice.reason
    choice = choose_decode_worker(view.routable(0.0), 1700, CONFIG)  # 107 blocks: b's pool, were it free
    assert (choice.worker_id, choice.reason) == (None, "overloaded")
    view = view_of(a=dict(), b=dict(block_size=32, kv_blocks_used=100))  # 3100 tokens: 97 blocks of 32 on b
    assert choose_decode_worker(view.routable(0.0), 3100, CONFIG).reason == "overloaded"  # b, once free, holds it


def test_config_rejects_zero_weights():
    with pytest.raises(ValueError, match="kv_weight"):
        DecodePolicyConfig(kv_weight=0, seqs_weight=0)


def test_the_worker_holding_the_conversation_wins_at_equal_load():
    view = view_of(a=dict(kv_blocks_used=20, num_running=2), b=dict(kv_blocks_used=20, num_running=2))
    assert choose_decode_worker(view.routable(0.0), 40, CONFIG).worker_id == "a"  # the tie goes to the first
    assert choose_decode_worker(view.routable(0.0), 40, CONFIG, {"b": 1.0}).worker_id == "b"
    assert choose_decode_worker(view.routable(0.0), 40, CONFIG, {"a": 0.2, "b": 0.9}).worker_id == "b"


def test_load_outweighs_affinity():
    # b holds the whole chain (credit 0.5); each running sequence more is 1/8 of batch fill
    for b_running, winner in [(0, "b"), (3, "b"), (5, "a"), (8, "a")]:
        view = view_of(a=dict(num_running=0), b=dict(num_running=b_running))
        choice = choose_decode_worker(view.routable(0.0), 40, CONFIG, {"b": 1.0})
        assert choice.worker_id == winner, b_running
    # so does KV usage: b's pool 60% fuller
    view = view_of(a=dict(kv_blocks_used=0), b=dict(kv_blocks_used=60))
    assert choose_decode_worker(view.routable(0.0), 40, CONFIG, {"b": 1.0}).worker_id == "a"


def test_affinity_never_admits_a_full_worker():
    view = view_of(a=dict(num_running=7), b=dict(num_running=8))
    assert choose_decode_worker(view.routable(0.0), 40, CONFIG, {"b": 1.0}).worker_id == "a"
    view = view_of(b=dict(num_running=8))
    assert choose_decode_worker(view.routable(0.0), 40, CONFIG, {"b": 1.0}).reason == "overloaded"


def test_affinity_credit_is_the_weighted_share_and_can_be_off():
    assert affinity_credit(1.0, CONFIG) == 0.5
    assert affinity_credit(0.5, DecodePolicyConfig(affinity_weight=2.0)) == 1.0
    assert affinity_credit(3.0, CONFIG) == 0.5  # a share is at most 1
    off = DecodePolicyConfig(affinity_weight=0.0)
    view = view_of(a=dict(), b=dict())
    assert choose_decode_worker(view.routable(0.0), 40, off, {"b": 1.0}).worker_id == "a"
    with pytest.raises(ValueError, match="affinity_weight"):
        DecodePolicyConfig(affinity_weight=-0.1)


def test_session_affinity_credits_the_leading_blocks_each_worker_holds():
    affinity = SessionAffinity()
    system, turn_1, answer_1 = [b"s0", b"s1"], [b"u0", b"u1"], [b"o0", b"o1"]
    affinity.note("a", system + [b"x0"])  # another conversation, same system prompt
    affinity.note("b", system + turn_1)  # turn 1 routed to b
    affinity.note("b", system + turn_1 + answer_1)  # its KvWarm: the whole chain
    turn_2 = system + turn_1 + answer_1 + [b"u2", b"u3"]
    assert affinity.leading("a", turn_2) == 2
    assert affinity.leading("b", turn_2) == 6
    assert affinity.shares(["a", "b", "c"], turn_2) == {"a": 0.25, "b": 0.75}
    assert affinity.shares(["a", "b"], []) == {}
    affinity.forget("b")  # restarted: its pool is empty
    assert affinity.shares(["a", "b"], turn_2) == {"a": 0.25}


def test_session_affinity_is_bounded_oldest_first():
    affinity = SessionAffinity(max_blocks_per_worker=3, max_workers=2)
    affinity.note("a", [b"0", b"1", b"2"])
    affinity.note("a", [b"0", b"3"])  # b"0" touched again: b"1" is now the oldest
    assert affinity.leading("a", [b"0", b"2", b"3"]) == 3
    assert affinity.leading("a", [b"1"]) == 0
    affinity.note("b", [b"0"])
    affinity.note("c", [b"0"])  # a, the least recently noted worker, goes
    assert affinity.shares(["a", "b", "c"], [b"0"]) == {"b": 1.0, "c": 1.0}

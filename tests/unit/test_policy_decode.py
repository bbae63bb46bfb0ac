"""Decode routing: KV usage and batch fill, the batch cap, free blocks."""

import pytest
from test_balancing_view import report

from ferry.balancing.view import WorkerView
from ferry_services.decode_balancer.policy import DecodePolicyConfig, blocks_needed, choose_decode_worker

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


def test_config_rejects_zero_weights():
    with pytest.raises(ValueError, match="kv_weight"):
        DecodePolicyConfig(kv_weight=0, seqs_weight=0)

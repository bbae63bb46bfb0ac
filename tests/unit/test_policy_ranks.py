"""Balancing worker groups the seed's way, per rank (`LoadReport.ranks`, ferry.balancing.ranks):
decode by each rank's KV usage and running requests, prefill by each rank's tokens and core
attention. A group's totals can look idle while the rank a sequence would land on is full."""

import pytest
from test_balancing_view import report

from ferry.balancing.ranks import rank_views
from ferry.balancing.view import WorkerView
from ferry.protocol import RankLoad
from ferry_services.decode_balancer.policy import DecodePolicyConfig, choose_decode_worker
from ferry_services.prefill_balancer.policy import PrefillPolicyConfig, choose_prefill_worker

pytestmark = pytest.mark.unit


def rank(i: int, running: int = 0, kv_used: int = 0, tokens: int = 0, attention: float = 0.0) -> RankLoad:
    return RankLoad(i, running, 0, tokens, attention, kv_used, 50, 4)


def group(worker_id: str, role: str, *ranks: RankLoad, **kw):
    totals = dict(
        num_running=sum(r.num_running for r in ranks),
        kv_blocks_used=sum(r.kv_blocks_used for r in ranks),
        kv_blocks_total=sum(r.kv_blocks_total for r in ranks),
        max_running=sum(r.max_running for r in ranks),
        num_queued_prefill_tokens=sum(r.num_queued_prefill_tokens for r in ranks),
    )
    return report(worker_id, role=role, ranks=list(ranks), **{**totals, **kw})


def test_routed_work_since_the_report_is_spread_over_the_ranks():
    view = WorkerView("decode")
    view.update(group("g", "decode", rank(0, running=1, kv_used=10), rank(1)), now=0.0)
    view.note_routed("g", blocks=6)
    view.note_routed("g", blocks=4)
    ranks = rank_views(view.workers["g"])
    assert [(r.num_seqs, r.kv_blocks_used) for r in ranks] == [(2.0, 15.0), (1.0, 5.0)]
    assert rank_views(_single()) == []  # a single-process worker has no ranks


def _single():
    view = WorkerView("decode")
    view.update(report("s", role="decode"), now=0.0)
    return view.workers["s"]


def test_decode_weighs_the_rank_a_sequence_lands_on_not_the_groups_totals():
    # equal totals (4 running, 40 of 100 blocks): the group's rank 1 is idle, the worker is even
    view = WorkerView("decode")
    view.update(group("g", "decode", rank(0, running=4, kv_used=40), rank(1)), now=0.0)
    view.update(report("w", role="decode", num_running=4, kv_blocks_used=40, kv_blocks_total=100, max_running=8), 0.0)
    assert choose_decode_worker(view.routable(0.0), 40, DecodePolicyConfig()).worker_id == "g"


def test_a_group_whose_every_rank_is_full_takes_nothing_though_its_totals_have_room():
    view = WorkerView("decode")
    # rank 0 at its batch cap, rank 1 without blocks for 40 tokens: 44 of 100 blocks free in total
    view.update(group("g", "decode", rank(0, running=4), rank(1, running=1, kv_used=48)), now=0.0)
    choice = choose_decode_worker(view.routable(0.0), 40, DecodePolicyConfig())
    assert (choice.worker_id, choice.reason) == (None, "overloaded")


def test_prefill_goes_to_the_group_whose_lightest_rank_finishes_it_first():
    config = PrefillPolicyConfig(attention_weight=1.0 / 64)
    view = WorkerView("prefill")
    # same tokens queued in total (200); the group has them on one rank, the worker on its only one
    view.update(group("g", "prefill", rank(0, tokens=200, attention=20000.0), rank(1)), now=0.0)
    view.update(report("w", num_queued_prefill_tokens=200), now=0.0)
    assert choose_prefill_worker(view.routable(0.0), 50, config).worker_id == "w"  # lockstep: g waits for rank 0
    view.update(
        group("g", "prefill", rank(0, tokens=100, attention=5000.0), rank(1, tokens=100, attention=5000.0)), 0.0
    )
    assert choose_prefill_worker(view.routable(0.0), 50, config).worker_id == "g"  # each rank half the queue


def test_core_attention_per_rank_counts_not_only_tokens():
    config = PrefillPolicyConfig(attention_weight=1.0 / 16)
    view = WorkerView("prefill")
    # both groups: 200 tokens on each rank; a's are long prompts (far more query-key pairs)
    view.update(
        group("a", "prefill", rank(0, tokens=200, attention=20000.0), rank(1, tokens=200, attention=20000.0)), 0
    )
    view.update(group("b", "prefill", rank(0, tokens=200, attention=2000.0), rank(1, tokens=200, attention=2000.0)), 0)
    assert choose_prefill_worker(view.routable(0.0), 20, config).worker_id == "b"

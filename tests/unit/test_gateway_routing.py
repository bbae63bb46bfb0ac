"""Routing token events to waiting requests (duplicates dropped) and worker liveness from load reports."""

from __future__ import annotations

import asyncio

import pytest
from reports import load_report

from ferry.protocol import ErrorEvent, LoadReport, OutputBatch, TokenEvent
from ferry_services.gateway.tracker import RequestTracker
from ferry_services.gateway.workers import MISSED_REPORTS, LiveWorkers

pytestmark = pytest.mark.unit


def tokens(request_id: str, index: int, ids: list[int], finish: str | None = None) -> TokenEvent:
    return TokenEvent(request_id, index=index, token_ids=ids, text="".join(f"<{i}>" for i in ids), finish_reason=finish)


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def test_events_reach_their_own_request_in_order():
    tracker = RequestTracker()
    a, b = tracker.open("a"), tracker.open("b")
    tracker.deliver(OutputBatch("w1", tokens=[tokens("a", 0, [1]), tokens("b", 0, [7])]))
    tracker.deliver(OutputBatch("w1", tokens=[tokens("a", 1, [2, 3], "stop")]))
    assert [e.token_ids for e in drain(a)] == [[1], [2, 3]]
    assert [e.token_ids for e in drain(b)] == [[7]]


async def test_repeated_events_are_dropped_by_index():
    tracker = RequestTracker()
    queue = tracker.open("a")
    first, second = tokens("a", 0, [1, 2]), tokens("a", 2, [3])
    for batch in ([first], [first, second], [second], [tokens("a", 1, [2])]):
        tracker.deliver(OutputBatch("w1", tokens=batch))
    assert [e.index for e in drain(queue)] == [0, 2]
    assert tracker.num_duplicates == 3


async def test_a_final_event_without_tokens_still_arrives():
    tracker = RequestTracker()
    queue = tracker.open("a")
    tracker.deliver(OutputBatch("w1", tokens=[tokens("a", 0, [5]), tokens("a", 1, [], "length")]))
    assert [e.finish_reason for e in drain(queue)] == [None, "length"]


async def test_errors_and_events_of_closed_requests():
    tracker = RequestTracker()
    queue = tracker.open("a")
    tracker.deliver(OutputBatch("w1", errors=[ErrorEvent("a", "internal", "boom"), ErrorEvent("zz", "internal", "x")]))
    assert [e.message for e in drain(queue)] == ["boom"]
    tracker.close("a")
    tracker.deliver(OutputBatch("w1", tokens=[tokens("a", 0, [1])]))
    assert tracker.num_orphans == 2 and len(tracker) == 0


def report(worker_id: str, role: str, draining: bool = False, decodes: bool = False) -> LoadReport:
    return load_report(worker_id, role, timestamp=0.0, draining=draining, decodes=decodes)


def test_a_worker_is_alive_until_it_misses_its_reports():
    live = LiveWorkers()
    live.observe(report("p1", "prefill"), now=100.0)
    live.observe(report("d1", "decode"), now=100.0)
    assert live.missing_roles(now=100.0 + MISSED_REPORTS) == []
    assert live.missing_roles(now=100.1 + MISSED_REPORTS) == ["prefill", "decode"]


def test_a_prefill_worker_that_decodes_counts_for_both_roles():
    live = LiveWorkers()
    live.observe(report("b1", "prefill", decodes=True), now=0.0)
    assert live.missing_roles(now=0.5) == []
    assert live.alive("decode", now=0.5) == live.alive("prefill", now=0.5) == ["b1"]
    live.observe(report("p1", "prefill"), now=0.0)
    assert live.alive("decode", now=0.5) == ["b1"]


def test_a_draining_worker_does_not_count():
    live = LiveWorkers()
    live.observe(report("p1", "prefill"), now=0.0)
    live.observe(report("p2", "prefill"), now=0.0)
    live.observe(report("p2", "prefill", draining=True), now=0.5)
    assert live.alive("prefill", now=1.0) == ["p1"]
    assert live.missing_roles(now=1.0) == ["decode"]


def test_long_gone_workers_are_forgotten():
    live = LiveWorkers()
    live.observe(report("p1", "prefill"), now=0.0)
    live.forget_stale(now=1000.0)
    live.observe(report("p2", "prefill"), now=1000.0)
    assert live.alive("prefill", now=1000.0) == ["p2"]
    assert len(live._reports) == 1

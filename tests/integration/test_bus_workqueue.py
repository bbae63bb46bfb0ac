"""JetStream work queues against a real nats-server: stream, per-worker consumers, variable batches."""

from __future__ import annotations

import pytest
from nats.js.api import RetentionPolicy

from ferry.bus import delete_work_consumer, ensure_work_consumer, ensure_work_stream, publish_work
from ferry.bus.workqueue import WORK_MAX_AGE_S
from ferry.protocol import Cancel, subjects

pytestmark = pytest.mark.integration


def work(i: int) -> Cancel:
    """Any registered message will do as a payload; Cancel is the smallest."""
    return Cancel(request_ids=[f"r{i}"])


async def queue(js, worker_id: str, num: int, start: int = 0, role: str = "prefill") -> None:
    for i in range(start, start + num):
        await publish_work(js, role, worker_id, work(i))


async def test_stream_setup_is_idempotent_and_a_work_queue(js):
    await ensure_work_stream(js)
    await ensure_work_stream(js)  # a second process starting does not fail
    info = await js.stream_info(subjects.WORK_STREAM)
    assert info.config.retention == RetentionPolicy.WORK_QUEUE
    assert info.config.subjects == [subjects.WORK_ALL]


async def test_fetch_returns_what_is_queued_up_to_the_limit(js):
    await ensure_work_stream(js)
    consumer = await ensure_work_consumer(js, "prefill", "w1")
    try:
        assert await consumer.fetch(8, Cancel) == []  # empty queue: nothing, no error

        await queue(js, "w1", 3)
        batch = await consumer.fetch(8, Cancel)
        assert [item.msg.request_ids for item in batch] == [["r0"], ["r1"], ["r2"]]
        for item in batch:
            await item.ack()

        await queue(js, "w1", 10, start=3)
        first = await consumer.fetch(4, Cancel)
        second = await consumer.fetch(8, Cancel)
        assert [i.msg.request_ids[0] for i in first] == ["r3", "r4", "r5", "r6"]
        assert [i.msg.request_ids[0] for i in second] == [f"r{i}" for i in range(7, 13)]
        for item in first + second:
            await item.ack()
        assert await consumer.fetch(8, Cancel) == []
    finally:
        await consumer.close()
    # work-queue retention: acked work is gone from the stream
    info = await js.stream_info(subjects.WORK_STREAM)
    assert info.state.messages == 0


async def test_num_pending_counts_queued_work_not_yet_pulled(js):
    """What a worker reports as its backlog: the balancers see work it has not pulled."""
    await ensure_work_stream(js)
    consumer = await ensure_work_consumer(js, "prefill", "w-backlog")
    try:
        assert await consumer.num_pending() == 0
        await queue(js, "w-backlog", 5)
        assert await consumer.num_pending() == 5
        pulled = await consumer.fetch(2, Cancel)
        assert [item.num_pending for item in pulled] == [4, 3]  # each message says what is queued behind it
        assert await consumer.num_pending() == 3  # pulled but not yet acked is no longer pending
        for item in pulled:
            await item.ack()
        assert await consumer.num_pending() == 3
        for item in await consumer.fetch(8, Cancel):
            await item.ack()
        assert await consumer.num_pending() == 0
    finally:
        await consumer.close()
        await delete_work_consumer(js, "prefill", "w-backlog")


async def test_each_worker_sees_only_its_own_work(js):
    await ensure_work_stream(js)
    a = await ensure_work_consumer(js, "prefill", "wa")
    b = await ensure_work_consumer(js, "decode", "wa")  # same id, other role: another queue
    try:
        await queue(js, "wa", 2, role="prefill")
        await queue(js, "wa", 1, start=10, role="decode")
        assert [i.msg.request_ids for i in await a.fetch(8, Cancel)] == [["r0"], ["r1"]]
        assert [i.msg.request_ids for i in await b.fetch(8, Cancel)] == [["r10"]]
    finally:
        await a.close()
        await b.close()


async def test_nak_redelivers_and_garbage_is_dropped_not_returned(js, nc):
    await ensure_work_stream(js)
    consumer = await ensure_work_consumer(js, "decode", "w2", ack_wait_s=5.0, max_deliver=3)
    try:
        await js.publish(subjects.work("decode", "w2"), b"not a ferry message")
        await queue(js, "w2", 1, role="decode")
        (item,) = await consumer.fetch(8, Cancel)
        assert consumer.num_bad == 1
        assert item.num_delivered == 1
        await item.nak()

        (again,) = await consumer.fetch(8, Cancel, timeout_s=2.0)
        assert again.msg == item.msg and again.num_delivered == 2
        await again.ack()
        assert await consumer.fetch(8, Cancel) == []  # the terminated garbage never comes back
    finally:
        await consumer.close()


async def test_consumer_setup_is_idempotent_and_deletable(js):
    await ensure_work_stream(js)
    name = subjects.work_consumer("prefill", "w3")
    first = await ensure_work_consumer(js, "prefill", "w3", ack_wait_s=30.0)
    await first.close()
    second = await ensure_work_consumer(js, "prefill", "w3", ack_wait_s=10.0)  # a restart with new settings
    await second.close()
    info = await js.consumer_info(subjects.WORK_STREAM, name)
    assert info.config.ack_wait == 10.0
    assert info.config.filter_subject == subjects.work("prefill", "w3")
    assert info.config.inactive_threshold == WORK_MAX_AGE_S  # abandoned consumers expire; nobody deletes them

    assert await delete_work_consumer(js, "prefill", "w3") is True
    assert await delete_work_consumer(js, "prefill", "w3") is False


async def test_queued_work_waits_for_a_worker_that_starts_later(js):
    await ensure_work_stream(js)
    await queue(js, "late", 2)  # balancer routed before the worker pulled once
    consumer = await ensure_work_consumer(js, "prefill", "late")
    try:
        assert len(await consumer.fetch(8, Cancel)) == 2
    finally:
        await consumer.close()


async def test_a_stream_that_differs_is_updated_once_and_said_so(js, caplog):
    import dataclasses
    import logging

    from ferry.bus import work_stream_config

    caplog.set_level(logging.INFO, logger="ferry.bus")
    await js.add_stream(dataclasses.replace(work_stream_config(), max_age=60.0))  # an older ferry's stream
    await ensure_work_stream(js)
    await ensure_work_stream(js)
    assert (await js.stream_info(subjects.WORK_STREAM)).config.max_age == work_stream_config().max_age
    assert caplog.text.count("updating stream FERRY_WORK: max_age: 60.0 -> 3600.0") == 1


async def test_more_replicas_than_the_server_has_is_a_clear_error(js):
    with pytest.raises(RuntimeError, match="FERRY_WORK_REPLICAS"):
        await ensure_work_stream(js, replicas=3)  # one nats-server: no room for 3 replicas

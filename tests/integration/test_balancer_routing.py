"""Both balancers against a real nats-server: load reports in, routed work in JetStream out,
rejections, and the queue of a worker that falls silent moving to a live one."""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import NoRespondersError
from reports import load_report
from waiting import wait_until

from ferry.bus import ensure_work_consumer, ensure_work_stream
from ferry.protocol import (
    BlockRef,
    GenerateRequest,
    Handoff,
    HandoffReply,
    LoadReport,
    PrefillWork,
    SamplingParams,
    SubmitReply,
    SubmitRequest,
    decode,
    encode,
    subjects,
)
from ferry_services.decode_balancer.service import DecodeBalancer
from ferry_services.decode_balancer.settings import DecodeBalancerSettings
from ferry_services.prefill_balancer.service import PrefillBalancer
from ferry_services.prefill_balancer.settings import PrefillBalancerSettings

pytestmark = pytest.mark.integration


def report(worker_id, role="prefill", interval_s=5.0, **kw) -> LoadReport:
    return load_report(worker_id, role, interval_s=interval_s, **{"model": "tiny", "kv_blocks_total": 64, **kw})


def request(i: int, num_tokens: int = 20) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{i}",
        gateway_id="gw",
        model="tiny",
        prompt_token_ids=list(range(1, num_tokens + 1)),
        sampling=SamplingParams(),
    )


async def publish_reports(nc, balancer, *reports: LoadReport) -> None:
    """Publish, then wait until the balancer holds exactly these reports: its subscription runs on its
    own connection, so a fixed sleep races it on a busy machine."""
    for r in reports:
        await nc.publish(subjects.load(r.role, r.worker_id), encode(r))
    await nc.flush()
    workers = balancer.runtime.view.workers
    for _ in range(500):
        if all(r.worker_id in workers and workers[r.worker_id].report == r for r in reports):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the balancer did not take in {[r.worker_id for r in reports]} within 5 s")


async def submit(nc, i: int, num_tokens: int = 20) -> SubmitReply:
    """One submit; retried while the server answers "no responders": the balancer subscribed (and flushed)
    on its own connection, and that interest can reach this connection's publishes a moment later (seen
    once in CI on the first test; nats-io/nats.rs#1274). Such a request reached nobody, so a retry is safe."""
    for _ in range(50):
        try:
            reply = await nc.request(subjects.SUBMIT, encode(SubmitRequest(request(i, num_tokens))), timeout=5)
            return decode(reply.data, SubmitReply)
        except NoRespondersError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{subjects.SUBMIT}: no balancer answered within 2.5 s")


async def queued(js, role: str, worker_id: str, msg_type) -> list:
    consumer = await ensure_work_consumer(js, role, worker_id)
    try:
        items = await consumer.fetch(100, msg_type, timeout_s=0.5)
        for item in items:
            await item.ack()
        return [item.msg for item in items]
    finally:
        await consumer.close()


@pytest.fixture
async def prefill_balancer(nc, nats_url):
    from ferry.bus import connect

    own = await connect(nats_url, "prefill-balancer-test")
    await ensure_work_stream(own.jetstream())
    balancer = PrefillBalancer(own, PrefillBalancerSettings(max_queued_tokens=1000, tick_s=0.1))
    await balancer.start()
    yield balancer
    await balancer.stop()
    await own.close()


@pytest.fixture
async def decode_balancer(nc, nats_url):
    from ferry.bus import connect

    own = await connect(nats_url, "decode-balancer-test")
    await ensure_work_stream(own.jetstream())
    balancer = DecodeBalancer(own, DecodeBalancerSettings(tick_s=0.1))
    await balancer.start()
    yield balancer
    await balancer.stop()
    await own.close()


async def test_submit_without_workers_says_no_workers(nc, prefill_balancer):
    reply = await submit(nc, 0)
    assert (reply.accepted, reply.reason) == (False, "no_workers")


async def test_burst_is_spread_over_prefill_workers_and_queued_in_jetstream(nc, js, prefill_balancer):
    await publish_reports(nc, prefill_balancer, report("pa"), report("pb"))
    replies = [await submit(nc, i) for i in range(6)]
    assert all(r.accepted for r in replies)
    assert sorted(r.worker_id for r in replies) == ["pa"] * 3 + ["pb"] * 3
    work = await queued(js, "prefill", "pa", PrefillWork)
    assert sorted(w.request.request_id for w in work) == sorted(r.request_id for r in replies if r.worker_id == "pa")
    assert work[0].request.prompt_token_ids == list(range(1, 21))


async def test_full_prefill_workers_mean_overloaded(nc, prefill_balancer):
    await publish_reports(nc, prefill_balancer, report("pa", num_queued_prefill_tokens=1000))
    reply = await submit(nc, 0)
    assert (reply.accepted, reply.reason, reply.retry_after_s) == (False, "overloaded", 1.0)


async def test_silent_prefill_workers_queue_moves_to_a_live_worker(nc, js, prefill_balancer):
    await ensure_work_consumer(js, "prefill", "dead")  # the worker made it, then died
    await publish_reports(
        nc, prefill_balancer, report("dead", interval_s=0.2), report("live", num_queued_prefill_tokens=900)
    )
    replies = [await submit(nc, i, num_tokens=10) for i in range(3)]
    assert [r.worker_id for r in replies] == ["dead"] * 3  # live is nearly full
    await publish_reports(nc, prefill_balancer, report("live", num_queued_prefill_tokens=0))  # live keeps reporting
    await wait_until(lambda: prefill_balancer.runtime.num_rerouted == 3, "3 messages re-routed")
    moved = await queued(js, "prefill", "live", PrefillWork)
    assert sorted(w.request.request_id for w in moved) == ["r0", "r1", "r2"]
    assert (await submit(nc, 9)).worker_id == "live"
    await wait_until(lambda: "dead" not in prefill_balancer.runtime.draining, "the dead worker's queue emptied")
    info = await js.consumer_info(subjects.WORK_STREAM, subjects.work_consumer("prefill", "dead"))
    assert (info.num_pending, info.num_ack_pending) == (0, 0)  # emptied, and kept: JetStream expires it
    micro = prefill_balancer.service.stats()
    assert (micro["reroute"].num_requests, micro["reroute"].num_errors) == (3, 0)
    assert micro["load"].num_requests == 3


async def test_a_worker_that_went_silent_and_came_back_keeps_its_consumer(nc, js, decode_balancer):
    """Its consumer is not deleted while it may live (KEDA's scaler, which reads that consumer, would
    fall back to the stream's last sequence and scale to the maximum): back, it pulls from it again."""
    consumer = await ensure_work_consumer(js, "decode", "da")
    try:
        await publish_reports(nc, decode_balancer, report("da", "decode", interval_s=0.1))
        await wait_until(lambda: "da" in decode_balancer.runtime.view.silent_ids, "da seen as silent")
        await wait_until(lambda: "da" not in decode_balancer.runtime.draining, "da's queue drained")
        await asyncio.sleep(0.3)  # a few more balancer ticks
        await js.consumer_info(subjects.WORK_STREAM, subjects.work_consumer("decode", "da"))  # still there
        await publish_reports(nc, decode_balancer, report("da", "decode"))  # it is back
        reply = await hand_off(nc, 1)
        assert (reply.accepted, reply.worker_id) == (True, "da")
        (item,) = await consumer.fetch(5, Handoff, timeout_s=2)  # the same bound subscription, never recreated
        assert item.msg.request.request_id == "r1"
        await item.ack()
    finally:
        await consumer.close()


async def test_bad_messages_in_a_silent_workers_queue_are_counted_and_dropped(nc, js, decode_balancer):
    await ensure_work_consumer(js, "decode", "gone")
    await js.publish(subjects.work("decode", "gone"), b"\xc1 not msgpack", stream=subjects.WORK_STREAM)
    await publish_reports(nc, decode_balancer, report("gone", "decode", interval_s=0.1))
    await wait_until(lambda: decode_balancer.service.stats()["reroute"].num_errors == 1, "the bad message counted")
    await wait_until(lambda: "gone" not in decode_balancer.runtime.draining, "the queue emptied")
    assert "bad_request" in decode_balancer.service.stats()["reroute"].last_error
    assert decode_balancer.runtime.num_rerouted == 0


def handoff(i: int, num_kv_tokens: int = 20) -> Handoff:
    blocks = [BlockRef(bytes([i]) * 16, 16), BlockRef(bytes([i + 1]) * 16, num_kv_tokens - 16)]
    return Handoff(
        request=request(i, num_kv_tokens - 1),
        prefill_worker_id="pa",
        kv_namespace="ns",
        kv_blocks=blocks,
        num_kv_tokens=num_kv_tokens,
    )


async def hand_off(nc, i: int) -> HandoffReply:
    reply = await nc.request(subjects.HANDOFF, encode(handoff(i)), timeout=5)
    return decode(reply.data, HandoffReply)


async def test_handoffs_respect_each_decode_workers_batch_cap(nc, js, decode_balancer):
    await publish_reports(
        nc,
        decode_balancer,
        report("da", "decode", max_running=2, num_running=1),
        report("db", "decode", max_running=3, num_running=1),
    )
    replies = [await hand_off(nc, i) for i in range(4)]
    assert sorted(r.worker_id for r in replies[:3]) == ["da", "db", "db"]
    assert (replies[3].accepted, replies[3].reason) == (False, "overloaded")
    work = await queued(js, "decode", "da", Handoff)
    assert [(h.request.request_id, h.decode_worker_id, h.num_kv_tokens) for h in work] == [
        (r.request_id, "da", 20) for r in replies[:3] if r.worker_id == "da"
    ]


async def test_decode_worker_without_free_blocks_gets_nothing(nc, decode_balancer):
    await publish_reports(nc, decode_balancer, report("da", "decode", kv_blocks_used=63))
    reply = await hand_off(nc, 0)  # 20 tokens + the next one need 2 blocks
    assert (reply.accepted, reply.reason) == (False, "overloaded")
    assert (await nc.request(subjects.HANDOFF, b"junk", timeout=5)).data  # a bad message is answered


async def test_tier_credits_come_from_the_environment(nc, monkeypatch):
    """FERRY_{DEVICE,HOST,REMOTE}_TIER_WEIGHT reach the balancer's prefix index (what routing credits a
    held block with), and a weight outside [0, 1] is refused with its name."""
    from pydantic import ValidationError

    monkeypatch.setenv("FERRY_HOST_TIER_WEIGHT", "0.4")
    monkeypatch.setenv("FERRY_REMOTE_TIER_WEIGHT", "0.1")
    balancer = PrefillBalancer(nc, PrefillBalancerSettings())
    config = balancer.prefixes.config
    assert (config.device_weight, config.host_weight, config.remote_weight) == (1.0, 0.4, 0.1)
    block = b"h0"
    balancer.prefixes.apply("stored", "ns", "pa", [block], tier="host")
    balancer.prefixes.apply("stored", "ns", "store", [block])
    assert balancer.prefixes.cached_tokens({"pa": "ns", "pb": "ns"}, [block], 10) == {"pa": 4, "pb": 1}
    monkeypatch.setenv("FERRY_HOST_TIER_WEIGHT", "1.5")
    with pytest.raises(ValidationError, match="host_tier_weight"):
        PrefillBalancerSettings()


async def test_a_restarted_decode_worker_loses_its_session_affinity(nc, decode_balancer):
    """A turn-end KvWarm credits the worker that decoded it, enough to outweigh a little more load; once that
    worker's report says it started anew (an empty pool), the credit is gone and load decides."""
    from ferry.protocol import KvWarm
    from ferry_services.decode_balancer.service import full_blocks

    warm_one = report("da", role="decode", kv_blocks_used=8, started_at=1.0)
    await publish_reports(nc, decode_balancer, warm_one, report("db", role="decode", started_at=1.0))
    chain = full_blocks(handoff(7))
    await nc.publish(subjects.KV_WARM, encode(KvWarm("turn-1", "ns", chain, worker_id="da")))
    await wait_until(lambda: decode_balancer.affinity.leading("da", chain) == 1, "the warm-up reached the balancer")
    assert decode_balancer.choose(handoff(7)).worker_id == "da"

    await publish_reports(nc, decode_balancer, report("da", role="decode", kv_blocks_used=8, started_at=2.0))
    assert decode_balancer.choose(handoff(7)).worker_id == "db"
    assert decode_balancer.affinity.leading("da", chain) == 0


async def route_a_burst_of_4_with_3_queued_behind_the_first(nc, prefill_balancer) -> None:
    """Submits r0..r3, r0 first; r0's routing waits until r1..r3 are queued at the balancer behind it."""
    send_prefetch = prefill_balancer.send_prefetch

    async def held_first(worker_id, request_id, prefetch):
        if request_id == "r0":
            service = prefill_balancer.service
            await wait_until(lambda: service.num_pending("submit") == 3, "3 submits queued behind r0", 10)
        await send_prefetch(worker_id, request_id, prefetch)

    prefill_balancer.send_prefetch = held_first
    first = asyncio.create_task(submit(nc, 0))
    await asyncio.sleep(0.1)  # r0 reaches the balancer first
    replies = await asyncio.gather(first, *(submit(nc, i) for i in range(1, 4)))
    assert all(r.accepted for r in replies)


async def test_routed_work_says_how_many_submits_the_balancer_holds_behind_it(nc, js, prefill_balancer):
    """A burst reaches the balancer faster than it routes (one submit at a time on its loop): each
    PrefillWork carries the submits still queued behind it, so the worker's admission window knows more
    of the burst is on its way before JetStream holds any of it (services/worker/window.py)."""
    await publish_reports(nc, prefill_balancer, report("pr"))
    await route_a_burst_of_4_with_3_queued_behind_the_first(nc, prefill_balancer)
    work = await queued(js, "prefill", "pr", PrefillWork)
    assert [(w.request.request_id, w.num_routing_behind) for w in work] == [("r0", 3), ("r1", 2), ("r2", 1), ("r3", 0)]


async def test_with_two_workers_routed_work_counts_its_share_of_the_submits_behind_it(nc, js, prefill_balancer):
    """Two routable workers split a burst: each PrefillWork counts half of the submits behind it, rounded up,
    so an idle worker does not hold its first step for prompts routed to the other."""
    await publish_reports(nc, prefill_balancer, report("pr"), report("ps"))
    await route_a_burst_of_4_with_3_queued_behind_the_first(nc, prefill_balancer)
    work = [w for worker in ("pr", "ps") for w in await queued(js, "prefill", worker, PrefillWork)]
    behind = sorted((w.request.request_id, w.num_routing_behind) for w in work)
    assert behind == [("r0", 2), ("r1", 1), ("r2", 1), ("r3", 0)]

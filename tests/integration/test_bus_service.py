"""ferry.bus.Service against a real nats-server: wrapped handlers, NATS micro discovery, pub/sub."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from nats.micro.service import ServiceInfo, ServiceStats

from ferry.bus import BusError, Service
from ferry.protocol import Cancel, ErrorReply, KvLookup, KvLookupReply, decode, encode

pytestmark = pytest.mark.integration

SUBJECT = "ferry.test.lookup"


async def lookup(req: KvLookup) -> KvLookupReply:
    if req.kv_namespace == "raise":
        raise RuntimeError("handler exploded")
    if req.kv_namespace == "multiline":
        raise BusError("bad_request", "line one\r\nline two")
    if req.kv_namespace == "refuse":
        raise BusError("overloaded", "try later")
    return KvLookupReply(num_cached_blocks=len(req.block_hashes))


async def ask(nc, data: bytes):
    reply = await nc.request(SUBJECT, data, timeout=2)
    return reply, decode(reply.data)


def lookup_bytes(namespace: str, num_blocks: int = 2) -> bytes:
    return encode(KvLookup(kv_namespace=namespace, block_hashes=[bytes(16)] * num_blocks))


async def micro(nc, verb: str, name: str = "lookup-svc") -> dict:
    reply = await nc.request(f"$SRV.{verb}.{name}", b"", timeout=2)
    return json.loads(reply.data)


@pytest.fixture
async def service(nc):
    svc = Service("lookup-svc", version="1.2.3", description="test lookups")
    svc.endpoint(SUBJECT, KvLookup, lookup, name="lookup")
    await svc.start(nc)
    yield svc
    await svc.stop()


async def test_handler_exception_becomes_error_reply_and_next_request_is_served(nc, service):
    reply, msg = await ask(nc, lookup_bytes("raise"))
    assert msg == ErrorReply(code="internal", message="RuntimeError('handler exploded')")
    assert reply.headers["Nats-Service-Error-Code"] == "internal"

    _, msg = await ask(nc, lookup_bytes("ok", num_blocks=3))
    assert msg == KvLookupReply(num_cached_blocks=3)

    stats = await micro(nc, "STATS")
    (endpoint,) = stats["endpoints"]
    assert stats["type"] == "io.nats.micro.v1.stats_response"
    assert (endpoint["name"], endpoint["subject"]) == ("lookup", SUBJECT)
    assert (endpoint["num_requests"], endpoint["num_errors"]) == (2, 1)
    assert "handler exploded" in endpoint["last_error"]


async def test_multiline_error_text_is_one_header_line_and_whole_in_the_reply(nc, service):
    reply, msg = await ask(nc, lookup_bytes("multiline"))
    assert msg == ErrorReply(code="bad_request", message="line one\r\nline two")
    assert reply.headers["Nats-Service-Error"] == "line one line two"
    _, msg = await ask(nc, lookup_bytes("ok"))
    assert msg == KvLookupReply(num_cached_blocks=2)


async def test_bus_error_answers_its_own_code(nc, service):
    _, msg = await ask(nc, lookup_bytes("refuse"))
    assert msg == ErrorReply(code="overloaded", message="try later")
    assert service.stats()["lookup"].num_errors == 1


@pytest.mark.parametrize(
    "garbage",
    [b"\xc1\xff not msgpack", encode(Cancel(request_ids=["r1"])), b"\x93\x01\xaakv_lookup\x81\xacblock_hashes\x01"],
)
async def test_garbage_bytes_get_bad_request_and_the_service_survives(nc, service, garbage):
    _, msg = await ask(nc, garbage)
    assert isinstance(msg, ErrorReply) and msg.code == "bad_request"
    assert msg.message  # names the problem

    _, msg = await ask(nc, lookup_bytes("ok"))
    assert msg == KvLookupReply(num_cached_blocks=2)
    counts = service.stats()["lookup"]
    assert (counts.num_requests, counts.num_errors) == (2, 1)


async def test_ping_and_info_describe_the_service(nc, service):
    ping = await micro(nc, "PING")
    assert ping["type"] == "io.nats.micro.v1.ping_response"
    assert (ping["name"], ping["version"], ping["id"]) == ("lookup-svc", "1.2.3", service.id)

    info = await micro(nc, "INFO")
    ServiceInfo.from_dict(info)  # parses as nats.micro's own client types
    ServiceStats.from_dict(await micro(nc, "STATS"))
    assert info["description"] == "test lookups"
    assert [(e["name"], e["subject"], e["queue_group"]) for e in info["endpoints"]] == [
        ("lookup", SUBJECT, "lookup-svc")
    ]
    # the all-services subject answers too (what `nats micro ls` asks)
    reply = await nc.request("$SRV.PING", b"", timeout=2)
    assert json.loads(reply.data)["name"] == "lookup-svc"


async def test_replicas_share_requests_through_the_queue_group(nc, service):
    second = Service("lookup-svc", version="1.2.3")
    second.endpoint(SUBJECT, KvLookup, lookup, name="lookup")
    await second.start(nc)
    try:
        for _ in range(40):
            await ask(nc, lookup_bytes("ok"))
        served = service.stats()["lookup"].num_requests, second.stats()["lookup"].num_requests
        assert sum(served) == 40  # each request answered once, not once per replica
        assert min(served) > 0
    finally:
        await second.stop()


async def test_subscription_survives_garbage_and_handler_errors(nc):
    received: list[list[str]] = []
    got = asyncio.Event()

    async def on_cancel(msg: Cancel) -> None:
        if msg.request_ids == ["boom"]:
            raise ValueError("bad cancel")
        received.append(msg.request_ids)
        got.set()

    svc = Service("cancel-svc")
    svc.subscribe("ferry.test.cancel", Cancel, on_cancel)
    await svc.start(nc)
    try:
        await nc.publish("ferry.test.cancel", b"garbage")
        await nc.publish("ferry.test.cancel", encode(Cancel(request_ids=["boom"])))
        await nc.publish("ferry.test.cancel", encode(Cancel(request_ids=["r1", "r2"])))
        await asyncio.wait_for(got.wait(), timeout=2)
        assert received == [["r1", "r2"]]
        counts = svc.stats()["ferry_test_cancel"]
        assert (counts.kind, counts.queue_group, counts.num_requests, counts.num_errors) == ("subscription", "", 3, 2)
    finally:
        await svc.stop()


async def test_stop_drains_and_leaves_discovery(nc, service):
    await service.stop()
    assert service.draining.is_set()
    with pytest.raises(Exception):  # nobody answers any more: no responders / timeout
        await nc.request(f"$SRV.PING.lookup-svc.{service.id}", b"", timeout=0.5)
    with pytest.raises(Exception):
        await nc.request(SUBJECT, lookup_bytes("ok"), timeout=0.5)


async def test_handlers_run_inside_their_request_context(nc):
    from ferry.logs import request_id_var
    from ferry.protocol import GenerateRequest, SamplingParams, SubmitReply, SubmitRequest

    async def submit(req: SubmitRequest) -> SubmitReply:
        return SubmitReply(request_id=request_id_var.get() or "", accepted=True)

    svc = Service("submit-svc")
    svc.endpoint("ferry.test.submit", SubmitRequest, submit)
    await svc.start(nc)
    try:
        request = GenerateRequest(
            request_id="req-5", gateway_id="gw", model="m", prompt_token_ids=[1], sampling=SamplingParams()
        )
        reply = await nc.request("ferry.test.submit", encode(SubmitRequest(request=request)), timeout=2)
        assert decode(reply.data) == SubmitReply(request_id="req-5", accepted=True)
    finally:
        await svc.stop()


async def test_empty_request_means_defaults_when_the_type_allows_it(nc):
    """What `nats req ferry.kv.stats ''` sends: answered when every field has a default."""
    from ferry.protocol import KvStats, KvStatsRequest

    async def stats(req: KvStatsRequest) -> KvStats:
        return KvStats(num_blocks=len(req.kv_namespace), num_bytes=0)

    svc = Service("stats-svc", version="1.0.0", description="defaults")
    svc.endpoint("ferry.test.stats", KvStatsRequest, stats)
    await svc.start(nc)
    try:
        reply = await nc.request("ferry.test.stats", b"", timeout=2)
        assert decode(reply.data) == KvStats(num_blocks=0, num_bytes=0)
    finally:
        await svc.stop()


async def test_empty_request_is_refused_when_fields_are_required(nc, service):
    _, msg = await ask(nc, b"")
    assert msg.code == "bad_request" and "KvLookup has required fields" in msg.message


async def test_inputs_and_subscriptions_are_endpoints_in_micro_stats_with_their_data(nc):
    """What `nats micro stats` shows of work that is not a request: a counted input (a worker's
    JetStream pulls) and a broadcast subscription, each with the `data` its callback returns."""
    got = asyncio.Event()

    async def on_cancel(msg: Cancel) -> None:
        got.set()

    svc = Service("input-svc")
    svc.subscribe("ferry.test.cancel", Cancel, on_cancel, name="cancel", data=lambda: {"seen": 1})
    work = svc.input("work", "ferry.work.decode.w1", data=lambda: {"num_steps": 7, "kv_usage": 0.25})
    await svc.start(nc)
    try:
        work.record(3_000)
        work.record(5_000, error="bad_request: not a Handoff")
        await nc.publish("ferry.test.cancel", encode(Cancel(request_ids=["r1"])))
        await asyncio.wait_for(got.wait(), timeout=2)
        stats = await micro(nc, "STATS", "input-svc")
        ServiceStats.from_dict(stats)  # still what nats.micro's own client reads
        by_name = {e["name"]: e for e in stats["endpoints"]}
        assert {k: by_name["work"][k] for k in ("subject", "queue_group", "num_requests", "num_errors")} == {
            "subject": "ferry.work.decode.w1",
            "queue_group": "",
            "num_requests": 2,
            "num_errors": 1,
        }
        assert by_name["work"]["last_error"] == "bad_request: not a Handoff"
        assert (by_name["work"]["processing_time"], by_name["work"]["average_processing_time"]) == (8_000, 4_000)
        assert by_name["work"]["data"] == {"num_steps": 7, "kv_usage": 0.25}
        assert (by_name["cancel"]["num_requests"], by_name["cancel"]["queue_group"]) == (1, "")
        assert by_name["cancel"]["data"] == {"seen": 1}
        info = await micro(nc, "INFO", "input-svc")
        assert {e["name"]: e["metadata"]["kind"] for e in info["endpoints"]} == {
            "cancel": "subscription",
            "work": "input",
        }
    finally:
        await svc.stop()


async def test_a_failing_stats_callback_is_reported_and_stats_still_answer(nc):
    def broken() -> dict:
        raise KeyError("gone")

    svc = Service("broken-data-svc")
    svc.input("work", "ferry.work.prefill.w", data=broken)
    await svc.start(nc)
    try:
        (endpoint,) = (await micro(nc, "STATS", "broken-data-svc"))["endpoints"]
        assert endpoint["data"] == {"error": "KeyError('gone')"}
    finally:
        await svc.stop()


async def test_metadata_changed_while_running_is_what_discovery_serves(nc):
    svc = Service("meta-svc")  # no metadata at start: the dict still has to be the live one
    await svc.start(nc)
    try:
        svc.metadata["degraded"] = "true"
        for verb in ("PING", "INFO", "STATS"):
            assert (await micro(nc, verb, "meta-svc"))["metadata"] == {"degraded": "true"}
    finally:
        await svc.stop()


def test_names_and_versions_are_checked_before_anything_connects():
    with pytest.raises(ValueError, match=re.escape("version='1.0'")):
        Service("ok", version="1.0")
    svc = Service("ok")
    svc.input("work", "ferry.work.decode.w")
    with pytest.raises(ValueError, match=re.escape("name='work' is already used by ferry.work.decode.w")):
        svc.subscribe("ferry.test.other", Cancel, None, name="work")


async def test_a_message_published_right_after_start_reaches_the_subscription(nc, nats_url):
    """start() returns once the server holds every subscription: a load report or cancel published the
    moment it returns is not lost (one flush was not enough: nats-py writes its PING ahead of buffered SUBs)."""
    from ferry.bus import connect, ensure_work_stream

    for attempt in range(30):
        own = await connect(nats_url, f"start-barrier-{attempt}")
        await ensure_work_stream(own.jetstream())  # a JetStream request first, as every balancer makes
        received = asyncio.Event()

        async def on_cancel(msg: Cancel, received=received) -> None:
            received.set()

        svc = Service("barrier-svc")
        svc.subscribe(f"ferry.test.barrier.{attempt}", Cancel, on_cancel)
        await svc.start(own)
        try:
            await nc.publish(f"ferry.test.barrier.{attempt}", encode(Cancel(request_ids=["r"])))
            await asyncio.wait_for(received.wait(), timeout=2)
        finally:
            await svc.stop()
            await own.close()

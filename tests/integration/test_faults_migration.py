"""Migration in the gateway, over a real nats-server: scripted workers (load reports, token events)
and a scripted prefill-balancer on `ferry.submit`, so each fault happens exactly where the test
says. A holder that stops reporting, a gap in the tokens, or a `worker_lost` error makes the gateway
resubmit prompt + tokens so far as attempt + 1; stale and repeated events never reach the client."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY
from reports import load_report
from waiting import wait_until

from ferry.protocol import (
    Cancel,
    ErrorEvent,
    ErrorReply,
    GenerateRequest,
    OutputBatch,
    SamplingParams,
    SubmitReply,
    SubmitRequest,
    TokenEvent,
    decode,
    encode,
    subjects,
)
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.errors import APIError
from ferry_services.gateway.generation import Generation

pytestmark = pytest.mark.integration

INTERVAL_S = 0.1
GATEWAY = "gw-migrate"


class Cluster:
    """Scripted workers and balancer: `alive` workers report every INTERVAL_S; submits go to the
    next id in `route`."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.alive = {"p1": "prefill", "p2": "prefill", "d1": "decode"}
        self.route = ["p1", "p2", "p2", "p2"]
        self.refusals: dict[int, str] = {}
        """Submit number (0 = the first) -> the reason it is refused with."""
        self.submitted: list[GenerateRequest] = []
        self.cancels: list[Cancel] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.nc.subscribe(subjects.SUBMIT, cb=self._on_submit)
        await self.nc.subscribe(subjects.CANCEL, cb=self._on_cancel)
        self._tasks.append(asyncio.create_task(self._report_forever()))
        await wait_until(  # set self.bus (the gateway's) first
            lambda: all(self.bus.workers.silent_for(w, time.monotonic()) is not None for w in self.alive),
            "every worker's load report reaches the gateway",
        )

    async def _on_submit(self, msg) -> None:
        request = decode(msg.data, SubmitRequest).request
        self.submitted.append(request)
        if len(self.submitted) - 1 in self.refusals:
            reason = self.refusals[len(self.submitted) - 1]
            refusal = (
                ErrorReply(reason, "refused")
                if reason == "bad_request"
                else SubmitReply(request.request_id, False, reason=reason)
            )
            await msg.respond(encode(refusal))
            return
        worker = self.route[min(len(self.submitted) - 1, len(self.route) - 1)]
        await msg.respond(encode(SubmitReply(request.request_id, True, worker_id=worker)))

    async def _on_cancel(self, msg) -> None:
        self.cancels.append(decode(msg.data, Cancel))

    async def _report_forever(self) -> None:
        while True:
            for worker_id, role in list(self.alive.items()):
                report = load_report(worker_id, role, interval_s=INTERVAL_S)
                await self.nc.publish(subjects.load(role, worker_id), encode(report))
            await asyncio.sleep(INTERVAL_S)

    async def send(self, worker_id: str, index: int, ids: list[int], attempt: int, finish: str | None = None) -> None:
        event = TokenEvent(
            "r1", index=index, token_ids=ids, text="".join(f"<{i}>" for i in ids), finish_reason=finish, attempt=attempt
        )
        await self.nc.publish(subjects.out(GATEWAY), encode(OutputBatch(worker_id, tokens=[event])))
        await self.nc.flush()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()


@pytest.fixture
async def cluster(nc, nats_url):
    cluster = Cluster(nc)
    bus = GatewayBus(GATEWAY, submit_timeout_s=2.0)
    await bus.start(nats_url)
    cluster.bus = bus
    await cluster.start()
    yield cluster
    await cluster.stop()
    await bus.stop()


def request(max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest("r1", GATEWAY, "m", [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0))


async def collect(gen: Generation, into: list[int]) -> None:
    async for event in gen.events():
        into.extend(event.token_ids)


def _migrations(reason: str) -> float:
    return REGISTRY.get_sample_value("ferry_migrations_total", {"reason": reason}) or 0.0


def _errors(kind: str) -> float:
    return REGISTRY.get_sample_value("ferry_errors_total", {"service": "gateway", "kind": kind}) or 0.0


async def test_a_silent_holder_is_migrated_with_the_tokens_so_far(cluster):
    migrations_before, errors_before = _migrations("worker_silent"), _errors("migrated")
    gen = Generation(cluster.bus, request(), timeout_s=10, max_attempts=3)
    await gen.start(16, 1.0, time.monotonic())
    got: list[int] = []
    reader = asyncio.create_task(collect(gen, got))
    await cluster.send("p1", 0, [10], attempt=0)
    await cluster.send("d1", 1, [11, 12], attempt=0)
    await wait_until(lambda: got == [10, 11, 12], "got == [10, 11, 12]", 5.0)
    del cluster.alive["d1"]  # SIGKILL: its reports stop
    cluster.alive["d2"] = "decode"
    await wait_until(lambda: len(cluster.submitted) == 2, "len(cluster.submitted) == 2", 5.0)
    again = cluster.submitted[1]
    assert again.attempt == 1 and again.output_token_ids == [10, 11, 12] and again.prompt_token_ids == [1, 2, 3]
    assert any(c.below_attempt == 1 and c.request_ids == ["r1"] for c in cluster.cancels)
    await cluster.send("d1", 3, [99], attempt=0)  # a stale copy still talking: dropped
    await cluster.send("p2", 3, [13], attempt=1)
    await cluster.send("p2", 3, [13], attempt=1)  # a repeat: dropped
    await cluster.send("d2", 4, [14, 15], attempt=1, finish="length")
    await asyncio.wait_for(reader, 5)
    assert got == [10, 11, 12, 13, 14, 15]
    assert cluster.bus.tracker.num_stale == 1 and cluster.bus.tracker.num_duplicates == 1
    # counted as a migration (the dashboard's panel), not as an error
    assert _migrations("worker_silent") == migrations_before + 1 and _errors("migrated") == errors_before
    await gen.close()


async def test_a_gap_in_the_tokens_is_redone_not_shown(cluster):
    gen = Generation(cluster.bus, request(), timeout_s=10, max_attempts=3)
    await gen.start(16, 1.0, time.monotonic())
    got: list[int] = []
    reader = asyncio.create_task(collect(gen, got))
    await cluster.send("p1", 0, [10, 11], attempt=0)
    await cluster.send("p1", 3, [13], attempt=0)  # token 2 went missing
    await wait_until(lambda: len(cluster.submitted) == 2, "len(cluster.submitted) == 2", 5.0)
    assert cluster.submitted[1].output_token_ids == [10, 11] and cluster.submitted[1].attempt == 1
    await cluster.send("p2", 2, [12, 13, 14, 15], attempt=1, finish="length")
    await asyncio.wait_for(reader, 5)
    assert got == [10, 11, 12, 13, 14, 15] and cluster.bus.tracker.num_gaps == 1
    assert _migrations("tokens_missing") >= 1
    await gen.close()


async def test_attempts_are_bounded_then_a_clear_503(cluster):
    gen = Generation(cluster.bus, request(), timeout_s=10, max_attempts=2)
    await gen.start(16, 1.0, time.monotonic())
    got: list[int] = []
    reader = asyncio.create_task(collect(gen, got))
    await cluster.send("p1", 0, [10], attempt=0)
    error = ErrorEvent("r1", "worker_lost", "decode worker went away", retryable=True, attempt=0)
    await cluster.nc.publish(subjects.out(GATEWAY), encode(OutputBatch("d1", errors=[error])))
    await wait_until(lambda: len(cluster.submitted) == 2, "len(cluster.submitted) == 2", 5.0)
    del cluster.alive["p2"]  # the second holder dies too: no third try
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(reader, 5)
    assert info.value.status == 503 and info.value.code == "worker_lost"
    assert "2 attempt(s)" in info.value.message and got == [10]
    await gen.close()
    await wait_until(
        lambda: any(c.below_attempt is None for c in cluster.cancels),
        "any(c.below_attempt is None for c in cluster.cancels)",
        5.0,
    )  # everything freed


async def test_a_refused_resubmit_is_tried_again_as_the_next_attempt(cluster):
    cluster.refusals = {1: "no_workers"}  # the first resubmit finds no worker
    gen = Generation(cluster.bus, request(), timeout_s=10, max_attempts=3)
    await gen.start(16, 1.0, time.monotonic())
    got: list[int] = []
    reader = asyncio.create_task(collect(gen, got))
    await cluster.send("p1", 0, [10], attempt=0)
    error = ErrorEvent("r1", "worker_lost", "decode worker went away", retryable=True, attempt=0)
    await cluster.nc.publish(subjects.out(GATEWAY), encode(OutputBatch("d1", errors=[error])))
    await wait_until(lambda: len(cluster.submitted) == 3, "len(cluster.submitted) == 3", 5.0)
    assert [r.attempt for r in cluster.submitted] == [0, 1, 2]
    assert any(c.below_attempt == 2 and "resubmit refused (no_workers)" in c.reason for c in cluster.cancels)
    await cluster.send("p2", 1, [11, 12], attempt=2, finish="length")
    await asyncio.wait_for(reader, 5)
    assert got == [10, 11, 12]
    await gen.close()


async def test_a_resubmit_refused_as_a_bad_request_is_not_retried(cluster):
    cluster.refusals = {1: "bad_request"}
    gen = Generation(cluster.bus, request(), timeout_s=10, max_attempts=5)
    await gen.start(16, 1.0, time.monotonic())
    got: list[int] = []
    reader = asyncio.create_task(collect(gen, got))
    error = ErrorEvent("r1", "worker_lost", "decode worker went away", retryable=True, attempt=0)
    await cluster.nc.publish(subjects.out(GATEWAY), encode(OutputBatch("d1", errors=[error])))
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(reader, 5)
    assert info.value.status == 503 and "could not resubmit after" in info.value.message
    assert len(cluster.submitted) == 2
    await gen.close()


async def test_silence_after_the_gateway_reconnects_is_resubmitted(tmp_path):
    """A NATS restart drops whatever was published while the gateway was not subscribed, maybe the
    request's last event: a request that hears nothing for a second after the reconnect is resubmitted.
    Meanwhile (nobody heard at all) no worker is judged lost: the silence was the gateway's."""
    import nats

    from ferry.launcher.servers import start_nats

    server = start_nats(store_dir=tmp_path / "nats")
    bus, nc, cluster = GatewayBus(GATEWAY, submit_timeout_s=2.0), None, None
    try:
        await bus.start(server.url)
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        cluster = Cluster(nc)
        cluster.bus = bus
        await cluster.start()
        gen = Generation(bus, request(), timeout_s=30, max_attempts=3)
        await gen.start(16, 1.0, time.monotonic())
        got: list[int] = []
        reader = asyncio.create_task(collect(gen, got))
        await cluster.send("d1", 0, [10, 11], attempt=0)
        await wait_until(lambda: got == [10, 11], "got == [10, 11]", 5.0)
        server.stop()
        await asyncio.sleep(1.0)  # > 3 report intervals with nobody heard
        assert len(cluster.submitted) == 1, "a worker was judged lost during the gateway's own outage"
        server = start_nats(port=server.port, store_dir=tmp_path / "nats")
        await wait_until(lambda: len(cluster.submitted) == 2, "len(cluster.submitted) == 2", 10)
        again = cluster.submitted[1]
        assert again.attempt == 1 and again.output_token_ids == [10, 11]
        await cluster.send("p2", 2, [12, 13, 14, 15], attempt=1, finish="length")
        await asyncio.wait_for(reader, 5)
        assert got == [10, 11, 12, 13, 14, 15]
        await gen.close()
    finally:
        if cluster is not None:
            await cluster.stop()
        await bus.stop()
        if nc is not None:
            await nc.close()
        server.stop()

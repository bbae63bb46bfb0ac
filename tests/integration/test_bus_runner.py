"""run_service: a real service process drains and exits 0 on SIGTERM/SIGINT; background failures exit 1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from ferry.bus import Service, connect, run_service
from ferry.protocol import KvLookup, KvLookupReply, decode, encode

pytestmark = pytest.mark.integration

SUBJECT = "ferry.example.lookup"


async def wait_for_stats(nc, predicate, timeout_s: float = 30.0) -> dict:
    """Poll `$SRV.STATS.ferry-example` until `predicate(endpoint_stats)` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            reply = await nc.request("$SRV.STATS.ferry-example", b"", timeout=0.5)
            (endpoint,) = json.loads(reply.data)["endpoints"]
            if predicate(endpoint):
                return endpoint
        except Exception:  # not up yet: no responders / timeout
            pass
        assert asyncio.get_running_loop().time() < deadline, "example service never reached the state"
        await asyncio.sleep(0.05)


@pytest.fixture
def example(nats_url):
    env = {**os.environ, "FERRY_NATS_URL": nats_url, "FERRY_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferry.bus.example", SUBJECT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_lets_the_in_flight_request_finish_then_exits_0(nc, example, sig):
    await wait_for_stats(nc, lambda e: True)  # up and registered
    slow = KvLookup(kv_namespace="sleep:1.0", block_hashes=[bytes(16)] * 3)
    pending = asyncio.create_task(nc.request(SUBJECT, encode(slow), timeout=10))
    await wait_for_stats(nc, lambda e: e["num_requests"] == 1)  # the handler is sleeping now

    example.send_signal(sig)
    reply = await pending
    assert decode(reply.data) == KvLookupReply(num_cached_blocks=3)
    exit_code = await asyncio.to_thread(example.wait, 20)
    stderr = example.stderr.read().decode()
    assert exit_code == 0, stderr
    assert "draining" in stderr and "stopped" in stderr
    with pytest.raises(Exception):  # gone from discovery
        await nc.request("$SRV.PING.ferry-example", b"", timeout=0.3)


async def test_failing_background_task_stops_the_service_with_exit_1(nats_url):
    service_nc = await connect(nats_url, name="runner-test")
    svc = Service("runner-test")
    svc.endpoint("ferry.test.runner", KvLookup, _never_called)
    shutdown_calls = []

    async def broken_loop() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("loop died")

    async def on_shutdown() -> None:
        shutdown_calls.append(svc.draining.is_set())

    exit_code = await asyncio.wait_for(
        run_service(service_nc, svc, background=[broken_loop()], on_shutdown=on_shutdown), timeout=10
    )
    assert exit_code == 1
    assert shutdown_calls == [True]
    assert service_nc.is_closed


async def test_stop_event_shuts_down_cleanly_and_cancels_background_work(nats_url):
    service_nc = await connect(nats_url, name="runner-test")
    svc = Service("runner-test")
    stop = asyncio.Event()
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def stop_soon() -> None:
        await asyncio.sleep(0.05)
        stop.set()

    exit_code = await asyncio.wait_for(
        run_service(service_nc, svc, background=[forever(), stop_soon()], stop=stop), timeout=10
    )
    assert exit_code == 0
    assert cancelled.is_set()
    assert service_nc.is_closed


async def _never_called(req: KvLookup) -> KvLookupReply:
    raise AssertionError("no request was sent")


def test_a_service_run_in_a_thread_stops_with_its_event(nats_url):
    """No signals off the main thread: the `stop` event alone ends it (embedding, e.g. in a test harness)."""
    import threading

    result: list[int] = []
    ready = threading.Event()

    async def main() -> None:
        nc = await connect(nats_url, name="thread-test")
        stop = asyncio.Event()
        svc = Service("thread-test")

        async def stop_when_started() -> None:
            ready.set()
            stop.set()

        result.append(await run_service(nc, svc, background=[stop_when_started()], stop=stop))

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    thread.join(timeout=20)
    assert ready.is_set() and result == [0]

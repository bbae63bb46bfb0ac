"""Local nats-server / redis-server processes (ferry.launcher.servers) and ferry.bus.connect over them."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from ferry.bus import connect, ensure_work_stream, publish_work
from ferry.launcher.servers import free_port, start_nats, start_redis
from ferry.protocol import Cancel, subjects

pytestmark = pytest.mark.integration


async def test_started_servers_answer_and_stop_cleans_up():
    nats_server, redis_server = start_nats(), start_redis(maxmemory="16mb")
    try:
        nc = await connect(nats_server.url, name="servers-test", connect_timeout_s=5)
        await ensure_work_stream(nc.jetstream())  # JetStream is on
        await nc.close()
        client = aioredis.Redis.from_url(redis_server.url)
        assert await client.ping() is True
        assert (await client.config_get("maxmemory-policy"))["maxmemory-policy"] == "allkeys-lru"
        await client.aclose()
    finally:
        nats_server.stop()
        redis_server.stop()
    for server in (nats_server, redis_server):
        assert server.process.returncode == 0
        assert not server.workdir.exists()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), timeout=0.5).close()


def test_a_server_that_cannot_start_raises_with_its_output():
    with start_nats() as first:
        with pytest.raises(RuntimeError, match="nats-server did not answer"):
            start_nats(port=first.port)  # port taken


async def test_connect_waits_for_a_server_that_starts_late(tmp_path):
    port = free_port()
    started = []

    async def start_later() -> None:
        await asyncio.sleep(0.5)
        started.append(await asyncio.to_thread(start_nats, port, tmp_path / "store"))

    starter = asyncio.create_task(start_later())
    try:
        nc = await connect(f"nats://127.0.0.1:{port}", name="late", connect_timeout_s=15)
        assert nc.is_connected
        await nc.close()
    finally:
        await starter
        started[0].stop()


async def test_connect_gives_up_after_its_timeout():
    with pytest.raises(Exception):
        await connect(f"nats://127.0.0.1:{free_port()}", name="nobody", connect_timeout_s=0.3)


async def test_client_reconnects_after_a_server_restart_and_jetstream_keeps_work(tmp_path):
    store = tmp_path / "store"
    server = start_nats(store_dir=store)
    nc = await connect(server.url, name="restart-test", connect_timeout_s=5, reconnect_wait_s=0.1)
    try:
        js = nc.jetstream()
        await ensure_work_stream(js)
        await publish_work(js, "prefill", "w1", Cancel(request_ids=["kept"]))
        server.stop()
        server = await asyncio.to_thread(start_nats, server.port, store)

        for _ in range(100):  # reconnect happens in the background
            if nc.is_connected:
                break
            await asyncio.sleep(0.05)
        assert nc.is_connected
        info = await js.stream_info(subjects.WORK_STREAM)
        assert info.state.messages == 1
    finally:
        await nc.close()
        server.stop()


async def test_connect_never_logs_credentials(caplog):
    """A URL with a password, unreachable, then a server that refuses it: the password appears in
    no log line and no error message (bus/connect.py logged the connected URL with user:password)."""
    import logging

    from ferry.bus.connect import CredentialsRefused

    caplog.set_level(logging.DEBUG, logger="ferry.bus")
    secret = "s3cret-pw"
    with pytest.raises(TimeoutError) as unreachable:
        await connect(f"nats://worker:{secret}@127.0.0.1:{free_port()}", name="nobody", connect_timeout_s=2)
    with start_nats() as server:
        port = server.port
    refusing = start_nats(port=port, extra_args=["--auth", "the-right-token"])
    try:
        with pytest.raises(CredentialsRefused) as refused:
            await connect(f"nats://{secret}@127.0.0.1:{port}", name="bad-token", connect_timeout_s=10)
        nc = await connect(f"nats://the-right-token@127.0.0.1:{port}", name="good-token", connect_timeout_s=5)
        await nc.close()
    finally:
        refusing.stop()
    shown = [r.getMessage() for r in caplog.records] + [str(unreachable.value), str(refused.value)]
    assert any("not reachable" in line for line in shown) and "***" in str(refused.value)
    assert not [line for line in shown if secret in line or "the-right-token" in line]


def _niceness_of_every_thread(pid: int) -> set[int]:
    """Field 19 of /proc/<pid>/task/<tid>/stat for each thread (the 17th after the ')' that ends the name)."""
    stats = [(task / "stat").read_text() for task in Path(f"/proc/{pid}/task").iterdir()]
    return {int(stat[stat.rindex(")") + 2 :].split()[16]) for stat in stats}


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and per-thread niceness are Linux's")
def test_servers_started_with_a_niceness_run_every_thread_at_it():
    base = os.nice(0)
    with start_nats(nice=5) as nats_server, start_redis(nice=5) as redis_server:
        for server in (nats_server, redis_server):
            assert _niceness_of_every_thread(server.process.pid) == {min(base + 5, 19)}
    with start_nats() as plain:
        assert _niceness_of_every_thread(plain.process.pid) == {base}

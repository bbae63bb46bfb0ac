"""ops/redis: a real redis-server started the way compose and Kubernetes start it (ops/redis/start.sh:
redis.conf + ACL users per role from users.acl) is an LRU cache where each role may do only its job."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

pytestmark = pytest.mark.ops

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {"worker": "test-worker-pw", "kvcache": "test-kvcache-pw", "admin": "test-admin-pw"}
START = ["sh", str(ROOT / "ops/redis/start.sh")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update({f"FERRY_REDIS_{user.upper()}_PASSWORD": pw for user, pw in PASSWORDS.items()})
    env.update(overrides)
    return env


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    binary = shutil.which("redis-server")
    assert binary, "redis-server not installed (ops/install.sh installs it)"
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    # The same overrides compose.yaml passes, plus a local port/bind/dir for the test.
    cmd = [*START, binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--maxmemory", "64mb"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def _as(port: int, user: str, **kwargs) -> redis.Redis:
    return redis.Redis(port=port, username=user, password=PASSWORDS[user], retry=Retry(NoBackoff(), 0), **kwargs)


def test_nobody_gets_in_without_a_user_of_ours(redis_port):
    anonymous = redis.Redis(port=redis_port, retry=Retry(NoBackoff(), 0))  # fail at once, no retries
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("anything")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=redis_port, username="worker", password="a-guess", retry=Retry(NoBackoff(), 0)).ping()
    for user in PASSWORDS:
        assert _as(redis_port, user).ping()


def test_a_worker_reads_and_writes_blocks_and_nothing_else(redis_port):
    worker = _as(redis_port, "worker")
    assert worker.set("ferry:kv:ns:00ff", b"block") and worker.get("ferry:kv:ns:00ff") == b"block"
    assert worker.exists("ferry:kv:ns:00ff") == 1
    for forbidden in (
        lambda: worker.set("other:key", b"x"),  # keys outside ferry:kv:
        lambda: worker.config_set("maxmemory", "1mb"),
        lambda: worker.flushall(),
        lambda: list(worker.scan_iter(match="ferry:kv:*")),
        lambda: worker.publish("__keyevent@0__:set", "forged"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()


def test_kvcache_configures_scans_and_listens_but_writes_nothing(redis_port):
    kvcache = _as(redis_port, "kvcache")
    assert kvcache.config_set("maxmemory-policy", "allkeys-lru")
    assert kvcache.info("memory")["used_memory"] > 0
    list(kvcache.scan_iter(match="ferry:kv:*"))
    pubsub = kvcache.pubsub()
    pubsub.psubscribe("__keyevent@0__:*")
    assert pubsub.get_message(timeout=2)["type"] == "psubscribe"
    pubsub.close()
    for forbidden in (lambda: kvcache.set("ferry:kv:ns:00ee", b"x"), lambda: kvcache.flushall()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()


async def test_ferry_code_runs_under_the_role_users(redis_port):
    """What the worker and kvcache services do, through their own code, as their own users."""
    import redis.asyncio as aioredis
    import torch

    from ferry.kvstore import KvStore, RedisTransport
    from ferry_services.kvcache import redis_admin

    url = f"redis://worker:{PASSWORDS['worker']}@127.0.0.1:{redis_port}/0"
    transport = RedisTransport(url)
    store = KvStore(transport, "acl-test")
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    await store.put_blocks(hashes, torch.ones(3, 2, 2, 16, 2, 8))
    assert await store.lookup(hashes) == 3
    assert (await store.get_blocks(hashes)).shape == (3, 2, 2, 16, 2, 8)
    await transport.close()

    client = aioredis.Redis.from_url(f"redis://kvcache:{PASSWORDS['kvcache']}@127.0.0.1:{redis_port}/0")
    capacity = await redis_admin.configure(client, "64mb", "allkeys-lru")
    assert capacity.eviction_policy == "allkeys-lru" and capacity.max_memory_bytes == 64 * 1024 * 1024
    assert len((await redis_admin.scan_blocks(client))["acl-test"]) == 3
    await client.aclose()


@pytest.mark.parametrize(("var", "value"), [("FERRY_REDIS_WORKER_PASSWORD", ""), ("FERRY_REDIS_ADMIN_PASSWORD", "a b")])
def test_start_refuses_a_missing_or_unsafe_password_by_name(var, value):
    result = subprocess.run(
        [*START, "redis-server", "--port", "0"], env=_env(**{var: value}), capture_output=True, text=True, timeout=10
    )
    assert result.returncode == 2 and var in result.stderr


def test_config_is_an_unpersisted_lru_cache(redis_port):
    r = _as(redis_port, "admin", decode_responses=True)
    assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert r.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
    assert r.config_get("save") == {"save": ""}
    assert r.config_get("appendonly") == {"appendonly": "no"}
    # what the kvcache service subscribes to: generic, string, expired, evicted key events
    assert set(r.config_get("notify-keyspace-events")["notify-keyspace-events"]) == set("Eg$xe")


def test_filling_past_maxmemory_evicts_instead_of_failing(redis_port):
    r = _as(redis_port, "admin")
    block = b"\x01" * (256 * 1024)  # a KV block of a small model
    pipe = r.pipeline(transaction=False)
    for i in range(400):  # 100 MiB into a 64 MiB cache: every SET must still succeed
        pipe.set(f"blk:{i}", block)
    assert all(pipe.execute())
    assert r.info("stats")["evicted_keys"] > 0
    assert r.get("blk:399") == block  # the newest block survives LRU eviction

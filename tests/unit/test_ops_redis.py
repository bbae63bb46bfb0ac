"""ops/redis/redis.conf: a real redis-server started with it is a password-protected LRU cache."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "test-redis-pw"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    binary = shutil.which("redis-server")
    assert binary, "redis-server not installed (ops/install.sh installs it)"
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    # The same overrides compose.yaml passes, plus a local port/bind/dir for the test.
    cmd = [
        binary,
        str(ROOT / "ops/redis/redis.conf"),
        "--requirepass",
        PASSWORD,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(workdir),
        "--maxmemory",
        "64mb",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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


def test_password_is_required(redis_port):
    anonymous = redis.Redis(port=redis_port, retry=Retry(NoBackoff(), 0))  # fail at once, no retries
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("anything")
    assert redis.Redis(port=redis_port, password=PASSWORD).ping()


def test_config_is_an_unpersisted_lru_cache(redis_port):
    r = redis.Redis(port=redis_port, password=PASSWORD, decode_responses=True)
    assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert r.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
    assert r.config_get("save") == {"save": ""}
    assert r.config_get("appendonly") == {"appendonly": "no"}
    # what the kvcache service subscribes to: generic, string, expired, evicted key events
    assert set(r.config_get("notify-keyspace-events")["notify-keyspace-events"]) == set("Eg$xe")


def test_filling_past_maxmemory_evicts_instead_of_failing(redis_port):
    r = redis.Redis(port=redis_port, password=PASSWORD)
    block = b"\x01" * (256 * 1024)  # a KV block of a small model
    pipe = r.pipeline(transaction=False)
    for i in range(400):  # 100 MiB into a 64 MiB cache: every SET must still succeed
        pipe.set(f"blk:{i}", block)
    assert all(pipe.execute())
    assert r.info("stats")["evicted_keys"] > 0
    assert r.get("blk:399") == block  # the newest block survives LRU eviction

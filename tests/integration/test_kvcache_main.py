"""`python -m ferry_services.kvcache` as a process: configured from FERRY_*, discoverable, stops on SIGTERM."""

import asyncio
import json
import os
import signal
import sys

import pytest

from ferry.protocol import KvStats, KvStatsRequest, decode, encode, subjects
from ferry.settings import SettingsError, load_settings
from ferry_services.kvcache.settings import KvCacheSettings

pytestmark = pytest.mark.integration


async def test_entry_point_serves_until_sigterm(nc, nats_url, redis_url, redis):
    env = {**os.environ, "FERRY_NATS_URL": nats_url, "FERRY_REDIS_URL": redis_url, "FERRY_LOG_LEVEL": "INFO"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ferry_services.kvcache", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        stats = await _until_healthy(nc)
        assert stats.num_blocks == 0 and stats.eviction_policy == "allkeys-lru"
        ping = json.loads((await nc.request("$SRV.PING.kvcache", b"", timeout=3)).data)
        assert ping["name"] == "kvcache" and ping["metadata"]["degraded"] == "false"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = (await proc.stderr.read()).decode()
    assert "kvcache healthy" in log and "draining" in log


async def _until_healthy(nc, timeout_s=30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            reply = decode((await nc.request(subjects.KV_STATS, encode(KvStatsRequest()), timeout=1)).data)
            if isinstance(reply, KvStats) and not reply.degraded:
                return reply
        except Exception:  # the process is still importing: no responders yet
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("kvcache did not become healthy")


def test_bad_capacity_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv("FERRY_KV_MAX_MEMORY", "2GB")
    assert load_settings(KvCacheSettings).kv_max_memory == "2GB"
    for var, value in (("FERRY_KV_MAX_MEMORY", "lots"), ("FERRY_KV_EVICTION_POLICY", "lru")):
        monkeypatch.setenv(var, value)
        with pytest.raises(SettingsError, match=var):
            load_settings(KvCacheSettings)
        monkeypatch.delenv(var)

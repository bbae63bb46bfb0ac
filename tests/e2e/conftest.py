"""Fixtures of the end-to-end tests: a tiny checkpoint and the whole system started by `ferry up`."""

from __future__ import annotations

from pathlib import Path

import pytest
from system_launch import pid_alive, start_system


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory) -> Path:
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("e2e") / "tiny-e2e", "llama", "tiny")


@pytest.fixture(scope="session")
def ds_model(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 checkpoint (MLA + MoE) the expert-parallel groups serve."""
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("ep-e2e") / "tiny-ds", "deepseek-v3", "tiny", seed=3)


@pytest.fixture(scope="module")
def system(e2e_model, nats_url, redis_url, tmp_path_factory):
    """2 prefill + 2 decode workers, both balancers, kvcache (when built) and the gateway."""
    running = start_system(e2e_model, nats_url, redis_url, tmp_path_factory.mktemp("run"), prefill=2, decode=2)
    yield running
    assert running.stop() == 0
    left = [name for name, pid in running.pids.items() if pid_alive(pid)]
    assert left == [], f"still running after ferry up stopped: {left}"


@pytest.fixture
def servers(tmp_path):
    """A nats-server and a redis-server of the test's own, for tests that plan and spawn services."""
    from ferry.launcher.servers import start_nats, start_redis

    nats_server, redis_server = start_nats(store_dir=tmp_path / "nats"), start_redis()
    yield nats_server, redis_server
    redis_server.stop()
    nats_server.stop()

"""Fixtures of the end-to-end tests: a tiny checkpoint and the whole system started by `ferry up`."""

from __future__ import annotations

from pathlib import Path

import pytest
from system_launch import pid_alive, start_system


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory) -> Path:
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("e2e") / "tiny-e2e", "llama", "tiny")


@pytest.fixture(scope="module")
def system(e2e_model, nats_url, redis_url, tmp_path_factory):
    """2 prefill + 2 decode workers, both balancers, kvcache (when built) and the gateway."""
    running = start_system(e2e_model, nats_url, redis_url, tmp_path_factory.mktemp("run"), prefill=2, decode=2)
    yield running
    assert running.stop() == 0
    left = [name for name, pid in running.pids.items() if pid_alive(pid)]
    assert left == [], f"still running after ferry up stopped: {left}"

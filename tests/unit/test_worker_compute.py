"""The worker's engine thread builds the engine too: one thread, hence one OpenMP pool, for every
torch call of the engine (services/worker/compute.py says why)."""

from __future__ import annotations

import threading

import pytest

from ferry_services.worker.compute import ComputeThread

pytestmark = pytest.mark.unit


class FakeEngine:
    def __init__(self) -> None:
        self.built_on = threading.get_ident()

    def stats(self) -> str:
        return f"stats@{threading.get_ident()}"

    def step(self) -> int:
        return threading.get_ident()


async def test_the_engine_is_built_on_the_thread_that_runs_its_steps():
    compute = ComputeThread()
    assert compute.stats is None
    engine = await compute.load(FakeEngine)
    assert compute.engine is engine and engine.built_on != threading.get_ident()
    assert await compute.call(engine.step) == engine.built_on
    assert compute.stats == f"stats@{engine.built_on}"
    compute.close()

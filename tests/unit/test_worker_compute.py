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


async def test_calls_run_before_the_steps_already_queued():
    """A pipelined worker keeps steps queued ahead; an addition queued after them still runs first,
    so it joins the next step. Calls keep their order, and steps theirs."""
    compute = ComputeThread()
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []
    first = compute.submit_step(lambda: (started.set(), gate.wait(5), ran.append("step 1")))  # holds the thread
    assert started.wait(5)
    queued = [compute.submit_step(lambda i=i: ran.append(f"step {i}")) for i in (2, 3)]
    calls = [compute.submit(ran.append, f"call {i}") for i in (1, 2)]
    gate.set()
    for future in (first, *queued, *calls):
        await future
    assert ran == ["step 1", "call 1", "call 2", "step 2", "step 3"]
    compute.close()


async def test_an_error_reaches_the_caller_and_close_cancels_what_is_queued():
    compute = ComputeThread()
    with pytest.raises(ZeroDivisionError):
        await compute.call(lambda: 1 / 0)
    started, gate = threading.Event(), threading.Event()
    running = compute.submit_step(lambda: (started.set(), gate.wait(5))[1])
    assert started.wait(5)
    waiting = compute.submit_step(lambda: "never")
    closing = threading.Thread(target=compute.close)
    closing.start()
    gate.set()
    closing.join(5)
    assert await running is True and waiting.cancelled()
    with pytest.raises(RuntimeError):
        compute.submit(print)

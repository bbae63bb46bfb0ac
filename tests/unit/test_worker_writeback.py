"""WriteBehind (services/worker/writeback.py): write-backs wait while the engine is busy, run once it is
idle, or once the oldest has waited max_delay_s, or once max_pending are queued; flush writes all now."""

import asyncio

import pytest

from ferry_services.worker.writeback import WriteBehind

pytestmark = pytest.mark.unit


def _queue(behind: WriteBehind, done: list[int], n: int) -> None:
    for i in range(n):

        async def write(i=i) -> None:
            done.append(i)

        behind.add(write)


async def _run_for(behind: WriteBehind, seconds: float) -> None:
    task = asyncio.create_task(behind.run())
    await asyncio.sleep(seconds)
    task.cancel()


async def test_waits_while_busy_and_writes_in_order_once_idle():
    busy, done = [True], []
    behind = WriteBehind(lambda: busy[0], max_delay_s=60.0, max_pending=100)
    task = asyncio.create_task(behind.run())
    _queue(behind, done, 3)
    await asyncio.sleep(0.12)
    assert done == []  # the engine is busy: nothing written yet
    busy[0] = False
    await asyncio.sleep(0.12)
    assert done == [0, 1, 2]
    task.cancel()


async def test_an_overdue_or_a_full_queue_is_written_while_busy():
    done: list[int] = []
    behind = WriteBehind(lambda: True, max_delay_s=0.05, max_pending=100)
    _queue(behind, done, 2)
    await _run_for(behind, 0.2)
    assert done == [0, 1]
    done.clear()
    full = WriteBehind(lambda: True, max_delay_s=60.0, max_pending=3)
    _queue(full, done, 4)
    await _run_for(full, 0.05)
    assert done == [0, 1]  # written until fewer than max_pending wait


async def test_flush_writes_everything_and_a_failure_does_not_stop_the_rest():
    done: list[int] = []
    behind = WriteBehind(lambda: True, max_delay_s=60.0, max_pending=100)

    async def fails() -> None:
        raise RuntimeError("redis down")

    behind.add(fails)
    _queue(behind, done, 2)
    await behind.flush()
    assert done == [0, 1] and not behind.pending

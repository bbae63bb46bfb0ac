"""A background loop whose cancellation was swallowed by something it awaited (asyncio.wait_for does
that on Python < 3.12 in a race, gh-86296) still ends, because it checks raise_if_cancelled."""

import asyncio
import sys

import pytest

from ferry.bus import raise_if_cancelled

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+"),
]


async def test_a_loop_whose_cancellation_was_swallowed_still_ends():
    swallowed, stop = asyncio.Event(), asyncio.Event()

    async def loop(check: bool) -> None:
        while not stop.is_set():
            if check:
                raise_if_cancelled()
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:  # what the racy wait_for does: the loop never sees it
                swallowed.set()

    checked, unchecked = asyncio.create_task(loop(True)), asyncio.create_task(loop(False))
    await asyncio.sleep(0)  # both loops start and wait in their sleep
    checked.cancel()
    unchecked.cancel()
    done, pending = await asyncio.wait({checked, unchecked}, timeout=1)
    assert swallowed.is_set()
    assert done == {checked} and checked.cancelled()
    assert pending == {unchecked}  # the same loop without the check runs on: the hang this prevents
    stop.set()
    await asyncio.wait_for(unchecked, 1)


def test_outside_a_cancelled_task_it_does_nothing():
    async def main() -> str:
        raise_if_cancelled()
        return "ran"

    assert asyncio.run(main()) == "ran"

"""Waiting on a condition instead of sleeping a fixed time (importable from every test: pytest puts
tests/ on sys.path for tests/conftest.py).

A fixed sleep is too short on a loaded machine and wastes time on a quiet one; a condition polled
every few ms returns as soon as it holds and fails with what it waited for.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


async def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 10.0, interval_s: float = 0.01):
    """Poll `condition` (sync or async) until it returns something truthy; return that value.
    AssertionError naming `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(interval_s)


def wait_until_sync(condition: Callable[[], object], what: str, timeout_s: float = 10.0, interval_s: float = 0.01):
    """wait_until for code outside an event loop (threads, subprocesses)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(interval_s)
    return value

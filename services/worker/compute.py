"""The engine's own thread: every engine call runs there, one at a time.

torch compute (a step can take 100s of ms on CPU) must not block the asyncio loop, or NATS I/O
(pulls, hand-offs, token events, load reports, KV transfers) would stall behind it. One worker
thread also means the engine is never touched by two threads at once: adds, aborts and steps
queue up in order. After every call a stats snapshot is taken there, so load reports never wait.

The engine is also *built* on this thread (`load`): libgomp keeps one OpenMP thread pool per thread
that opens parallel regions, and once the pools' threads outnumber the cores it throttles their
spin-waiting, so every parallel op of a step waits for sleeping threads to wake. A model loaded on
one thread and run on another made each step ~20% slower (issue #22, 2 cores).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeThread:
    def __init__(self, engine: Any = None) -> None:
        self.engine = engine
        self.stats = engine.stats() if engine is not None else None
        """The engine's EngineStats after the last call (read from any thread)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferry-engine")

    async def load(self, build: Callable[..., Any], *args: Any) -> Any:
        """Build the engine on this thread (see the module docstring) and keep it; -> the engine."""
        self.engine = await self.call(build, *args)
        self.stats = self.engine.stats()
        return self.engine

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` on the engine thread and wait for it without blocking the loop."""
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Queue `fn` on the engine thread now (calls run in the order queued); await the result later."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, functools.partial(self._run, fn, args, kwargs))

    def _run(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            if self.engine is not None:
                self.stats = self.engine.stats()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

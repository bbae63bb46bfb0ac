"""The engine's own thread: every engine call runs there, one at a time.

torch compute (a step can take 100s of ms on CPU) must not block the asyncio loop, or NATS I/O
(pulls, hand-offs, token events, load reports, KV transfers) would stall behind it. One worker
thread also means the engine is never touched by two threads at once: adds, aborts and steps
queue up in order. After every call a stats snapshot is taken there, so load reports never wait.

The engine is also *built* on this thread (`load`): libgomp keeps one OpenMP thread pool per thread
that opens parallel regions, and once the pools' threads outnumber the cores it throttles their
spin-waiting, so every parallel op of a step waits for sleeping threads to wake. A model loaded on
one thread and run on another made each step ~20% slower (issue #22, 2 cores).

Two lanes: engine steps (`submit_step`) and every other call (`submit`: additions, aborts, KV
takes). Calls run in the order queued, and before any step still waiting: a pipelined worker keeps
the next steps queued ahead (base.py), and an addition must join the next step, not wait behind them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

Job = tuple[concurrent.futures.Future, Callable[..., Any], tuple, dict]


class ComputeThread:
    def __init__(self, engine: Any = None) -> None:
        self.engine = engine
        self.stats = engine.stats() if engine is not None else None
        """The engine's EngineStats after the last call (read from any thread)."""
        self._calls: deque[Job] = deque()
        self._steps: deque[Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="ferry-engine", daemon=True)
        self._thread.start()

    async def load(self, build: Callable[..., Any], *args: Any) -> Any:
        """Build the engine on this thread (see the module docstring) and keep it; -> the engine."""
        self.engine = await self.call(build, *args)
        self.stats = self.engine.stats()
        return self.engine

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` on the engine thread and wait for it without blocking the loop."""
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Queue `fn` on the engine thread now, ahead of the steps queued (calls run in the order queued);
        await the result later."""
        return self._queue(self._calls, fn, args, kwargs)

    def submit_step(self, fn: Callable[..., T]) -> asyncio.Future[T]:
        """Queue a step: it runs after every call queued before it starts, and after the steps before it."""
        return self._queue(self._steps, fn, (), {})

    def _queue(self, lane: deque[Job], fn: Callable[..., Any], args: tuple, kwargs: dict) -> asyncio.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine thread is closed")
            lane.append((future, fn, args, kwargs))
            self._wake.notify()
        return asyncio.wrap_future(future, loop=asyncio.get_running_loop())

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._calls or self._steps or self._closed):
                    self._wake.wait()
                if not (self._calls or self._steps):
                    return  # closed, nothing left
                future, fn, args, kwargs = (self._calls or self._steps).popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._run(fn, args, kwargs))
                except BaseException as exc:  # handed to the awaiting side, as concurrent.futures does
                    future.set_exception(exc)

    def _run(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            if self.engine is not None:
                self.stats = self.engine.stats()

    def close(self) -> None:
        """Let the call in progress end, cancel what is queued, stop the thread."""
        with self._wake:
            self._closed = True
            for future, *_ in (*self._calls, *self._steps):
                future.cancel()
            self._calls.clear()
            self._steps.clear()
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

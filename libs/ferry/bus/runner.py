"""Run a service until SIGTERM/SIGINT, then drain and exit cleanly.

Shutdown order matters: first stop taking new messages and let in-flight handlers finish
(`Service.stop` drains), then the service's own cleanup (`on_shutdown`, e.g. a worker reporting
itself as draining), then background loops are cancelled, and last the connection is drained so
every reply and event already published reaches the server.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from nats.aio.client import Client

from ferry.bus.connect import drain_or_close
from ferry.bus.service import Service

log = logging.getLogger("ferry.bus")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the running task was cancelled and something swallowed it.

    On Python < 3.12, `asyncio.wait_for` (which nats-py's requests and fetches use) can swallow a
    cancellation that lands just as its inner await completes (CPython gh-86296): the awaiting loop
    then runs on, and whoever cancelled it and awaits it (shutdown, a test teardown) waits forever.
    A background loop calls this once per iteration; Task.cancelling() still counts the request."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


async def run_service(
    nc: Client,
    service: Service,
    *,
    background: Iterable[Coroutine[Any, Any, Any]] = (),
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until a stop signal (or `stop` is set); returns 0, or 1 if a background task failed."""
    stop = stop or asyncio.Event()
    coros = list(background)
    loop = asyncio.get_running_loop()
    signals = _install_signal_handlers(loop, stop)
    tasks: list[asyncio.Task] = []
    try:
        await service.start(nc)
        tasks = [asyncio.create_task(coro) for coro in coros]
        exit_code = await _wait(stop, tasks)
        log.info("service %s draining", service.name)
        await _shutdown(nc, service, tasks, on_shutdown)
        log.info("service %s stopped", service.name)
        return exit_code
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        for task in tasks:
            task.cancel()
        if not tasks:  # start failed: close the coroutines instead of leaving them never awaited
            for coro in coros:
                coro.close()


def _install_signal_handlers(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> list[signal.Signals]:
    """Signals only reach the main thread's loop; elsewhere (a service run in a thread) `stop` alone ends it."""
    installed = []
    for sig in STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, _on_signal, sig, stop)
        except (RuntimeError, ValueError, NotImplementedError):
            log.debug("cannot handle %s in this thread; stop with the `stop` event", sig.name)
            continue
        installed.append(sig)
    return installed


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("received %s", sig.name)
    stop.set()


async def _wait(stop: asyncio.Event, tasks: list[asyncio.Task]) -> int:
    """Until `stop` is set (0) or a background task raises (1); tasks that return are fine."""
    stopper = asyncio.create_task(stop.wait())
    pending: set[asyncio.Task] = {stopper, *tasks}
    try:
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and not task.cancelled() and task.exception() is not None:
                    log.error("background task failed; shutting down", exc_info=task.exception())
                    return 1
            if stopper in done:
                return 0
    finally:
        stopper.cancel()


async def _shutdown(
    nc: Client, service: Service, tasks: list[asyncio.Task], on_shutdown: Callable[[], Awaitable[None]] | None
) -> None:
    await service.stop()
    if on_shutdown is not None:
        try:
            await on_shutdown()
        except Exception:  # still drain the connection: in-flight replies must go out
            log.exception("on_shutdown failed")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await drain_or_close(nc)

"""TokenStream: a worker's token events onto `ferry.out.<gateway>`, held back per stream for
FERRY_STREAM_INTERVAL_MS (coalesce.py says what is held and what goes at once) and flushed on a timer,
so that nothing waits for a step that does not come."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client

from ferry.protocol import OutputBatch, encode, subjects
from ferry_services.worker.coalesce import StreamCoalescer


class TokenStream:
    def __init__(self, nc: Client, worker_id: str, interval_s: float) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.coalescer = StreamCoalescer(interval_s)
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task | None = None
        self._order = asyncio.Lock()
        """Held events are taken and sent under it: a stream's events leave in order even if a publish waits."""

    @property
    def num_held(self) -> int:
        """Streams with tokens held back now."""
        return len(self.coalescer)

    async def publish(self, batches: dict[str, OutputBatch]) -> None:
        """One step's events: what is due goes out now, the rest is held (interval 0: all goes out)."""
        if self.coalescer.interval_s <= 0:
            await self._send(batches)
            return
        async with self._order:
            await self._send(self.coalescer.add(batches, time.monotonic(), self.worker_id))
        self._arm()

    async def flush(self, request_id: str | None = None) -> None:
        """Send what is held now: of one request (before its error event), or all (before a halt)."""
        async with self._order:
            if request_id is None:
                await self._send(self.coalescer.take_all(self.worker_id))
            else:
                await self._send(self.coalescer.take(request_id, self.worker_id))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        due = self.coalescer.next_due()
        if due is None or self._timer is not None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + max(0.0, due - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self._flush_due())

    async def _flush_due(self) -> None:
        async with self._order:
            await self._send(self.coalescer.due(time.monotonic(), self.worker_id))
        self._arm()

    async def _send(self, batches: dict[str, OutputBatch]) -> None:
        for gateway_id, batch in batches.items():
            await self.nc.publish(subjects.out(gateway_id), encode(batch))

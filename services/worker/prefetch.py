"""Prefetch: blocks a routed request will need, fetched from the store into the host tier while the
request waits in this worker's queue, so its admission finds them local (no Redis on its path).

The prefill-balancer sends a `KvPrefetch` (`ferry.kv.prefetch.<worker>`) when it routes a prompt
whose leading blocks the store holds and this worker does not. Lowest priority, never in the way:
one prefetch at a time, a bounded queue (the oldest is dropped when full), blocks already here are
skipped, a cancelled request's prefetch is dropped (or stopped), and the engine thread only
sees a dict insert behind its current step. Admission (`settle`) takes a prefetch of its own request
off the queue when it has not started (admission fetches then, once) or waits for the one running.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ferry.kvstore import KvStoreError
from ferry.protocol import KvPrefetch

log = logging.getLogger(__name__)

MAX_PENDING = 16
"""Prefetches waiting; past this the oldest is dropped (its request is the likeliest to be admitted already)."""
SETTLE_TIMEOUT_S = 1.0
"""Most an admission waits for the running prefetch of its own request before fetching itself."""


@dataclass(slots=True)
class PrefetchStats:
    num_received: int = 0
    num_dropped: int = 0
    """Dropped unstarted: queue full, cancelled, or taken back by their own admission."""
    num_fetched_blocks: int = 0
    num_skipped_blocks: int = 0
    """Blocks already in the pool or host tier when their prefetch ran."""
    num_failures: int = 0


class Prefetcher:
    def __init__(self, worker: Any) -> None:
        self.worker = worker
        """The worker whose `store`, `engine`, `compute` and `namespace` it uses."""
        self.stats = PrefetchStats()
        self._pending: OrderedDict[str, KvPrefetch] = OrderedDict()
        self._wake = asyncio.Event()
        self._running: tuple[str, asyncio.Task] | None = None

    async def offer(self, prefetch: KvPrefetch) -> None:
        """A `KvPrefetch` arrived (subscription handler)."""
        self.stats.num_received += 1
        if prefetch.kv_namespace != self.worker.namespace or self.worker.engine.host is None:
            self.stats.num_dropped += 1
            return
        self._pending[prefetch.request_id] = prefetch
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
            self.stats.num_dropped += 1
        self._wake.set()

    def cancel(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._pending.pop(request_id, None) is not None:
                self.stats.num_dropped += 1
            if self._running is not None and self._running[0] == request_id:
                self._running[1].cancel()

    async def settle(self, request_id: str) -> None:
        """Before `request_id` is admitted: drop its unstarted prefetch, or wait (bounded) for the running one."""
        if self._pending.pop(request_id, None) is not None:
            self.stats.num_dropped += 1
        if self._running is not None and self._running[0] == request_id:
            await asyncio.wait([self._running[1]], timeout=SETTLE_TIMEOUT_S)

    async def run(self) -> None:
        """Background loop: one prefetch at a time, oldest first."""
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            request_id, prefetch = self._pending.popitem(last=False)
            task = asyncio.create_task(self.fetch(prefetch.block_hashes))
            self._running = (request_id, task)
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:  # shutting down: stop the fetch too
                task.cancel()
                raise
            finally:
                self._running = None
            if not task.cancelled() and task.exception() is not None:
                log.warning("prefetch for %s failed", request_id, exc_info=task.exception())

    async def fetch(self, block_hashes: list[bytes]) -> int:
        """Fetch the blocks neither the pool nor the host tier holds into the host tier; how many."""
        worker = self.worker
        missing = [h for h in block_hashes if not worker.engine.num_cached_blocks([h])]
        self.stats.num_skipped_blocks += len(block_hashes) - len(missing)
        if not missing:
            return 0
        try:
            data = await worker.store.get_blocks(missing)
        except KvStoreError as exc:
            self.stats.num_failures += 1
            log.info("prefetch of %d blocks failed: %s", len(missing), exc)
            return 0
        if data is None:  # evicted from the store meanwhile: admission will compute what is missing
            self.stats.num_failures += 1
            return 0
        num_new = await worker.compute.call(worker.engine.prefetch_to_host, missing, data)
        self.stats.num_fetched_blocks += num_new
        return num_new

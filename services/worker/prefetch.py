"""Prefetch: blocks a routed request will need, fetched from the store into the host tier while the
request waits in this worker's queue, so its admission finds them local (no Redis on its path).

The prefill-balancer sends a `KvPrefetch` (`ferry.kv.prefetch.<worker>`) when it routes a prompt
whose leading blocks the store holds and this worker does not. Lowest priority, never in the way:
one prefetch at a time, a bounded queue (the oldest is dropped when full), blocks already here are
skipped, a cancelled request's prefetch is dropped (or stopped), and the engine thread only
sees a dict insert behind its current step. Admission (`settle`) takes a prefetch of its own request
off the queue when it has not started (admission fetches then, once) or waits for the one running.

Warm-ups (`KvPrefetch.warm`: a finished turn's blocks, sent while its user thinks, `KvWarm`) wait in
their own bounded queue and run only when no request's prefetch waits; an admitted prompt that needs
blocks of a running warm-up waits for it (bounded) and takes those of an unstarted one back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ferry.bus import trace
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
    num_warm: int = 0
    """Of those received, warm-ups (a finished turn's blocks, no request yet)."""
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
        self._warm: OrderedDict[str, KvPrefetch] = OrderedDict()
        """Warm-ups, run when `_pending` is empty."""
        self._wake = asyncio.Event()
        self._running: tuple[KvPrefetch, asyncio.Task] | None = None

    async def offer(self, prefetch: KvPrefetch) -> None:
        """A `KvPrefetch` arrived (subscription handler)."""
        self.stats.num_received += 1
        self.stats.num_warm += prefetch.warm
        trace.hop(prefetch.request_id, "pf.offer")
        if prefetch.kv_namespace != self.worker.namespace or self.worker.engine.host is None:
            self.stats.num_dropped += 1
            return
        pending = self._warm if prefetch.warm else self._pending
        pending[prefetch.request_id] = prefetch
        while len(pending) > MAX_PENDING:
            pending.popitem(last=False)
            self.stats.num_dropped += 1
        self._wake.set()

    def cancel(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._pending.pop(request_id, None) is not None:
                self.stats.num_dropped += 1
            if self._running is not None and self._running[0].request_id == request_id:
                self._running[1].cancel()

    async def settle(self, request_id: str, block_hashes: list[bytes]) -> None:
        """Before `request_id` (its prompt's full blocks: `block_hashes`) is admitted: drop its unstarted
        prefetch and the unstarted warm-ups of its blocks, or wait (bounded) for a running one of either."""
        if self._pending.pop(request_id, None) is not None:
            self.stats.num_dropped += 1
        needed = set(block_hashes)
        for warm_id in [i for i, p in self._warm.items() if not needed.isdisjoint(p.block_hashes)]:
            del self._warm[warm_id]
            self.stats.num_dropped += 1
        running = self._running
        if running is None:
            return
        prefetch, task = running
        if prefetch.request_id == request_id or (prefetch.warm and not needed.isdisjoint(prefetch.block_hashes)):
            await asyncio.wait([task], timeout=SETTLE_TIMEOUT_S)

    async def run(self) -> None:
        """Background loop: one prefetch at a time, oldest first, requests' before warm-ups."""
        while True:
            if not self._pending and not self._warm:
                self._wake.clear()
                await self._wake.wait()
                continue
            request_id, prefetch = (self._pending or self._warm).popitem(last=False)
            trace.hop(request_id, "pf.start")
            task = asyncio.create_task(self.fetch(prefetch.block_hashes))
            self._running = (prefetch, task)
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:  # shutting down: stop the fetch too
                task.cancel()
                raise
            finally:
                self._running = None
                trace.hop(request_id, "pf.done")
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
        # said now, not after this worker's next step: every balancer replica credits them (and stops
        # asking for them) at once, not only the one that sent the prefetch
        host_changes = await worker.compute.call(worker.engine.drain_host_events)
        await worker.publish_pool_changes(([], []), host_changes)
        return num_new

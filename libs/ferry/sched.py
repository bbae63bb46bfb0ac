"""The calling thread's Linux scheduling policy, following its load (issue #22).

Under SCHED_OTHER a thread woken by a message preempts whatever runs on its core at once. On a box
with as many busy OpenMP threads as cores, the thread it preempts is one of the engine's team, and the
whole team then waits for it at the next barrier. Under SCHED_BATCH the woken thread runs at the next
tick instead. On 2 cores a 48-request burst through `ferry up` ran 5-20% faster with the worker's
asyncio thread and the gateway under SCHED_BATCH (ops/bench/throughput/README.md, tenth round and the
lead's follow-up); the wait for the tick costs a request's hops TTFT (+20 ms p50 at 2 req/s on a box
near its capacity; nothing measurable at 0.5 req/s). A thread runs SCHED_BATCH only while its process
serves a few streams at once (the defaults: 4), so a lone request is never delayed by it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class BatchWhenBusy:
    """`update(load)` from the thread it governs: SCHED_BATCH from `busy_from` up, SCHED_OTHER again
    under half of it (no switch per call at the edge). busy_from 0, or a system without SCHED_BATCH:
    nothing happens. The niceness is the thread's own either way (the policy leaves it alone)."""

    def __init__(self, busy_from: int) -> None:
        if busy_from < 0:
            raise ValueError(f"busy_from {busy_from}: 0 (never) or a positive load")
        self.busy_from = busy_from
        self.is_batch = False
        self.is_enabled = busy_from > 0 and hasattr(os, "SCHED_BATCH")

    def update(self, load: int) -> bool:
        """Whether the thread now runs SCHED_BATCH."""
        if not self.is_enabled:
            return False
        wanted = load >= max(1, self.busy_from // 2) if self.is_batch else load >= self.busy_from
        if wanted != self.is_batch:
            policy = os.SCHED_BATCH if wanted else os.SCHED_OTHER
            try:
                os.sched_setscheduler(0, policy, os.sched_param(0))
            except OSError as exc:  # e.g. a sandbox that forbids it: keep the normal policy for good
                log.warning("scheduling policy: cannot switch this thread (%s); it keeps SCHED_OTHER", exc)
                self.is_enabled = False
                return False
            self.is_batch = wanted
        return self.is_batch

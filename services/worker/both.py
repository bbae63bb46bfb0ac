"""The both-roles worker (`FERRY_ROLE=both`): prefills what it pulls and keeps decoding it itself.

One process, one engine (role 'both'), no hand-off: the KV never leaves the pool, and on a small
machine one process uses the cores that a prefill and a decode process would fight over. It pulls
`PrefillWork` as a prefill worker does (same subjects, consumer and load reports, with
`LoadReport.decodes` set, so the gateway counts it as a decode worker too), publishes every step's
tokens, and settles a message when its sequence finishes. The engine loop is pipelined (the next
step computes while this one's tokens go out); the pool's prefix-cache changes are taken on the
engine thread after each step and published for the prefill-balancer's cache-aware routing. With
FERRY_KV_WRITEBACK a finished sequence's blocks also go to the store, as a decode worker's do
(writeback.py): the next turn finds them even on another worker or after a restart.
"""

from __future__ import annotations

import functools
from collections import deque

from ferry.bus import trace
from ferry_services.worker.base import Worker
from ferry_services.worker.prefill import PrefillWorker
from ferry_services.worker.writeback import write_back


class BothWorker(PrefillWorker):
    decodes = True
    pipelined = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_written_back_blocks = 0
        """Blocks of finished sequences written to the store (FERRY_KV_WRITEBACK)."""
        if self.settings.kv_writeback:
            self.start_write_back()
        self.pool_changes: deque[tuple[tuple[list[bytes], list[bytes]], ...]] = deque()
        """The pool's and the host tier's (stored, removed) block hashes per step, appended on the engine
        thread (deque: thread-safe)."""

    def step(self):
        """Runs on the engine thread."""
        outputs = super().step()
        self.pool_changes.append((self.engine.drain_kv_events(), self.engine.drain_host_events()))
        return outputs

    async def after_step(self, outputs: list) -> None:
        tracing, writeback = trace.enabled(), self.settings.kv_writeback
        owners = [  # looked up before a finished one is released, and only where needed (a step's hot path)
            (o, self.ledger.owner(o.request_id))
            for o in outputs
            if tracing or (writeback and o.finish_reason is not None)
        ]
        await Worker.after_step(self, outputs)  # publish the tokens; a finished sequence settles its message
        if writeback:
            for out, request in owners:
                if out.finish_reason is not None and request is not None:
                    self.queue_write_back(functools.partial(self._write_back, out.request_id, request))
        if tracing:  # by the request's id, as the gateway stamps it (out.request_id is the engine's)
            for request in filter(None, (request for _, request in owners)):
                trace.hop(request.request_id, "bw.published")
        while self.pool_changes:
            await self.publish_pool_changes(*self.pool_changes.popleft())

    async def _write_back(self, sequence_id, request) -> None:
        """The whole conversation so far to the store (what it lacks of it) and a `KvWarm`: another
        worker, or this one restarted, finds the next turn's history there (writeback.py)."""
        self.num_written_back_blocks += await write_back(self, sequence_id, request, skip_prompt=False)

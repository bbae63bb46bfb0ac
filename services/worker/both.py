"""The both-roles worker (`FERRY_ROLE=both`): prefills what it pulls and keeps decoding it itself.

One process, one engine (role 'both'), no hand-off: the KV never leaves the pool, and on a small
machine one process uses the cores that a prefill and a decode process would fight over. It pulls
`PrefillWork` as a prefill worker does (same subjects, consumer and load reports, with
`LoadReport.decodes` set, so the gateway counts it as a decode worker too), publishes every step's
tokens, and settles a message when its sequence finishes. The engine loop is pipelined (the next
step computes while this one's tokens go out); the pool's prefix-cache changes are taken on the
engine thread after each step and published for the prefill-balancer's cache-aware routing.
"""

from __future__ import annotations

from collections import deque

from ferry.bus import trace
from ferry_services.worker.base import Worker
from ferry_services.worker.prefill import PrefillWorker


class BothWorker(PrefillWorker):
    decodes = True
    pipelined = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pool_changes: deque[tuple[tuple[list[bytes], list[bytes]], ...]] = deque()
        """The pool's and the host tier's (stored, removed) block hashes per step, appended on the engine
        thread (deque: thread-safe)."""

    def step(self):
        """Runs on the engine thread."""
        outputs = super().step()
        self.pool_changes.append((self.engine.drain_kv_events(), self.engine.drain_host_events()))
        return outputs

    async def after_step(self, outputs: list) -> None:
        await Worker.after_step(self, outputs)  # publish the tokens; a finished sequence settles its message
        if trace.enabled():
            for out in outputs:
                trace.hop(out.request_id, "bw.published")
        while self.pool_changes:
            await self.publish_pool_changes(*self.pool_changes.popleft())

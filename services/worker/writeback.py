"""Write-back at turn end (FERRY_KV_WRITEBACK): a finished sequence's full blocks go to the store, and a
`KvWarm` with the conversation's whole chain goes to the prefill-balancers, so that the next turn (which
re-sends prompt + output + a new message) finds its history in the store, prefetched into the worker
that will prefill it while the user thinks. Best effort, after the tokens went out.

A decode worker skips the prompt's blocks (the prefill worker stored them before the hand-off); a
both-roles worker stored nothing of it yet, so it asks the store how much of the chain it holds (one
lookup) and writes the rest.

Write-behind (`WriteBehind`, with FERRY_KV_WRITEBACK_DELAY_S > 0; the default 0 writes at once): a
write-back waits while the engine has work, for at most FERRY_KV_WRITEBACK_DELAY_S, and runs as soon as
the engine is idle: copying a finished sequence's KV out
of the pool (on the engine thread) and sending it to Redis cost ~20% of a 2-core box's CPU under a
burst (issue #22: the bench model's 48-request burst moves ~180 MB of fp32 KV), time the running
sequences' steps lost. The next turn of a conversation comes after the user has read the answer, when
the worker is usually idle; what waits longer than the delay is written anyway, so under steady load the
store lags by at most that. Best effort as before: blocks the pool evicted meanwhile are not written
(the turn after is recomputed or found in the worker's host tier, never wrong).
Why it is off by default: the KvWarm that has the next turn's history prefetched goes out after the write,
so while the worker stays busy (many conversations at once) a delayed write-back means the next turn's
prefill recomputes the previous answer. The multi-turn bench with a 5 s delay (8 users, answers 256,
think 1 s): turns >= 2 TTFT p50 on/off ~1.0x instead of 2.5-3.3x. A deployment of single-turn bursts
on few cores can set it (+9% `ferry up` burst throughput on 2 cores at 5 s, ops/bench/throughput).
`ferry up` sets 5 s when one worker of layout both serves everything (its default on <= 4 cores): no
other worker is there to prefetch a conversation from the store, and the next turn finds its history in
this worker's pool (or host tier), so the delay costs that deployment nothing but a store that lags.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ferry.kvstore import KvStoreError
from ferry.protocol import GenerateRequest, KvWarm, encode, subjects

log = logging.getLogger(__name__)


async def write_back(worker: Any, sequence_id: str, request: GenerateRequest, skip_prompt: bool) -> int:
    """Store `sequence_id`'s full blocks past the prompt (`skip_prompt`) or past those the store holds,
    then publish its chain as a `KvWarm`; how many blocks were written."""
    skip = len(request.prompt_token_ids) // worker.settings.block_size if skip_prompt else 0
    taken = await worker.compute.call(worker.engine.take_finished_chain, sequence_id, skip)
    if taken is None:
        return 0
    chain, copy, partial = taken
    data = await copy.result()  # the copy out of the pool, under way since the engine thread took it
    # its partial last block too (the answer's last 1..block_size-1 tokens): the next turn, which extends
    # them, copies it instead of computing them again (ferry.engine.partial_blocks)
    written = chain + ([partial] if partial is not None else [])
    try:
        start = 0 if skip_prompt else await worker.store.lookup(chain)
        if skip + start < len(written):
            await worker.store.put_blocks(written[skip + start :], data[start:])
    except KvStoreError as exc:
        log.info("KV of %s not written back: %s", request.request_id, exc)
        return 0
    if not chain:
        return len(written) - skip - start
    # the next turn starts with this chain: a prefill-balancer has it prefetched where that turn will go,
    # the decode-balancers credit this worker (it holds the chain) for decoding it
    warm = KvWarm(request.request_id, worker.namespace, chain, worker_id=worker.worker_id, partial_hash=partial)
    await worker.nc.publish(subjects.KV_WARM, encode(warm))
    return max(0, len(written) - skip - start)


POLL_S = 0.05
"""How often waiting write-backs look whether the engine is idle."""


class WriteBehind:
    """Write-backs queued while `is_busy()`, each run once the engine is idle or it has waited
    `max_delay_s` (or `max_pending` wait: the engine remembers only so many finished chains), oldest first."""

    def __init__(self, is_busy: Callable[[], bool], max_delay_s: float, max_pending: int) -> None:
        self.is_busy = is_busy
        self.max_delay_s = max_delay_s
        self.max_pending = max_pending
        self.pending: deque[tuple[float, Callable[[], Awaitable[Any]]]] = deque()
        self._added = asyncio.Event()

    def add(self, write: Callable[[], Awaitable[Any]]) -> None:
        """Queue `write()` (a write-back coroutine function)."""
        self.pending.append((time.monotonic(), write))
        self._added.set()

    def _due(self) -> bool:
        added_at = self.pending[0][0]
        overdue = time.monotonic() - added_at >= self.max_delay_s or len(self.pending) >= self.max_pending
        return overdue or not self.is_busy()

    async def run(self) -> None:
        while True:
            await self._added.wait()
            self._added.clear()
            while self.pending:
                if not self._due():
                    await asyncio.sleep(POLL_S)
                    continue
                await self._write(self.pending.popleft()[1])

    async def flush(self) -> None:
        """Write everything queued now (shutdown: the engine must still be there)."""
        while self.pending:
            await self._write(self.pending.popleft()[1])

    @staticmethod
    async def _write(write: Callable[[], Awaitable[Any]]) -> None:
        try:
            await write()
        except asyncio.CancelledError:
            raise
        except Exception:  # best effort: one failed write-back must not stop the others
            log.warning("a KV write-back failed", exc_info=True)

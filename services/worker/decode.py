"""The decode worker: prefilled sequences in, one token per engine step out, batched per gateway.

Pulls `Handoff`s from `ferry.work.decode.<id>` while it has room under its batch cap; each one's
KV blocks are fetched from the store (`KvStore.get_blocks`) on the asyncio thread while the
running batch keeps stepping on the engine thread, then loaded into the pool and joined to the
batch (`engine.add_prefilled`). The message is acked once the sequence is in the engine. Blocks
that are missing (evicted, Redis down, another model) are recomputed from the tokens instead:
counted in `num_recomputed` and logged, never silent.
"""

from __future__ import annotations

import logging

from ferry.bus import WorkItem
from ferry.kvstore import KvStoreError
from ferry.protocol import Handoff
from ferry_services.worker.base import Worker

log = logging.getLogger(__name__)

RETRY_ADMIT_S = 0.5
"""A hand-off that does not fit now goes back to the queue for this long."""


class DecodeWorker(Worker):
    role = "decode"
    work_type = Handoff
    pipelined = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_transferred = 0
        """Sequences whose KV came from the store."""
        self.num_recomputed = 0
        """Sequences whose KV was missing and had to be recomputed."""

    async def accept(self, item: WorkItem) -> None:
        handoff: Handoff = item.msg
        request_id = handoff.request.request_id
        if not self.is_new(request_id, handoff.request.attempt):
            if request_id in self.cancelled or self.is_stale(request_id, handoff.request.attempt):
                await item.ack()
            return
        await self.drop_older_attempt(request_id)
        self.hold(handoff.request, item)
        self.spawn(self.admit(handoff))

    async def admit(self, handoff: Handoff) -> None:
        """Fetch the blocks (overlapping the running batch's steps), then join the batch."""
        request_id = handoff.request.request_id
        data = await self.load_blocks(handoff)
        if not self.is_current(handoff.request):
            return  # cancelled (or replaced by a newer attempt) while the blocks travelled
        if data is None:
            self.num_recomputed += 1
            log.warning("KV of %s not in the store (%d tokens): recomputing it", request_id, handoff.num_kv_tokens)
        try:
            admitted = await self.add_to_engine(self._join, handoff, data)
        except ValueError as exc:  # the sequence does not fit this engine at all
            await self.publish_error(handoff.request, "bad_request", str(exc), retryable=False)
            admitted = True  # settled for good
            self.forget(request_id)
        else:  # added (or refused for room): drop it if a cancel raced the addition
            if await self.abort_if_gone(handoff.request):
                return
        if not admitted:  # no room after all (the balancer's view was stale): back to the queue
            self.forget(request_id)
            item = self.held.pop(request_id)
            await item.nak(RETRY_ADMIT_S)
            return
        self.num_transferred += data is not None
        await self.settle(request_id)
        self.has_work.set()

    async def load_blocks(self, handoff: Handoff):
        """[n, *block_shape] KV of the hand-off, or None when it cannot be used."""
        if handoff.num_kv_tokens == 0:
            return None
        if handoff.kv_namespace != self.namespace:
            log.warning(
                "KV of %s is from model %s, this worker runs %s",
                handoff.request.request_id,
                handoff.kv_namespace,
                self.namespace,
            )
            return None
        try:
            return await self.store.get_blocks([b.block_hash for b in handoff.kv_blocks])
        except KvStoreError as exc:
            log.warning("KV store failed for %s: %s", handoff.request.request_id, exc)
            return None

    def _join(self, handoff: Handoff, data) -> bool:
        """Runs on the engine thread. False when there is no room now."""
        request = handoff.request
        if data is None:  # the engine queues it and prefills prompt + streamed tokens again
            self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                request.output_token_ids,
                request.arrival_time or None,
            )
            return True
        if not self.engine.can_admit(len(request.all_token_ids)):
            return False
        self.engine.add_prefilled(
            request.request_id,
            request.prompt_token_ids,
            request.output_token_ids,
            request.sampling,
            data,
            handoff.num_kv_tokens,
        )
        return True

"""The prefill worker: prompt in, first token out at once, KV to the store, sequence handed on.

Pulls `PrefillWork` from `ferry.work.prefill.<id>` while its token budget allows; each engine
step's first tokens go to `ferry.out.<gateway>` right away (TTFT), then, while the next step
computes, the sequence's KV blocks are written to the store (`KvStore.put_blocks`) and a
`Handoff` is offered on `ferry.handoff` until a decode-balancer accepts it. Only then is the
JetStream message acked, so a prefill worker that dies mid-way leaves its work to be redone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ferry import metrics
from ferry.bus import WorkItem, trace
from ferry.kvstore import KvStoreError
from ferry.kvstore.index import MAX_HASHES_PER_EVENT
from ferry.protocol import (
    Handoff,
    HandoffReply,
    KvEvent,
    PrefillWork,
    ProtocolError,
    decode,
    encode,
    hash_full_blocks,
    subjects,
)
from ferry_services.worker.base import Worker
from ferry_services.worker.events import handoff_blocks

log = logging.getLogger(__name__)

HANDOFF_REQUEST_TIMEOUT_S = 5.0
MAX_RETRY_DELAY_S = 1.0


class PrefillWorker(Worker):
    role = "prefill"
    work_type = PrefillWork

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_handoffs = 0
        self.num_kv_store_failures = 0
        self.num_prefix_blocks_reused = 0
        """Leading prompt blocks fetched from the store instead of computed."""
        self.num_prefix_fetch_failures = 0

    def pull_budget(self) -> int:
        if self.compute.stats.num_queued_prefill_tokens >= self.settings.max_batch_tokens:
            return 0  # the next steps are full already: leave the rest to less busy workers
        return super().pull_budget()

    async def accept(self, item: WorkItem) -> None:
        request = item.msg.request
        trace.hop(request.request_id, "pw.pulled")
        if not self.is_new(request.request_id, request.attempt):
            if request.request_id in self.cancelled or self.is_stale(request.request_id, request.attempt):
                await item.ack()
            return  # a redelivery of what we hold: the held copy gets settled
        await self.drop_older_attempt(request.request_id)
        if item.msg.routed_at:
            log.debug("%s pulled %.1f ms after routing", request.request_id, (time.time() - item.msg.routed_at) * 1000)
        self.hold(request, item)
        metrics.PREFIX_CACHE_QUERIES.labels(self.role).inc(len(request.all_token_ids))
        try:
            prefix = await self.fetch_prefix(request, item.msg.num_cached_blocks_hint)
            trace.hop(request.request_id, "pw.prefix")
            if not self.is_current(request):
                return  # cancelled or replaced while the prefix travelled: settled there
            admitted = prefix is not None and await self.add_to_engine(self._admit_with_prefix, request, *prefix)
            if not admitted:
                await self.add_to_engine(
                    self.engine.add_request,
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling,
                    request.output_token_ids,
                    request.arrival_time or None,
                )
        except ValueError as exc:  # does not fit this model: the client's fault, not retryable
            await self.publish_error(request, "bad_request", str(exc), retryable=False)
            self.forget(request.request_id)
            await self.settle(request.request_id)
            return
        if await self.abort_if_gone(request):
            return
        self.has_work.set()

    async def fetch_prefix(self, request, num_cached_blocks_hint: int = 1) -> tuple | None:
        """(kv_data, num_tokens) of the prompt's leading full blocks from the store, when the store
        holds more of them than this worker's own pool; None to compute (or hit locally) instead.

        A hint of 0 (the balancer knows of no block of this prompt in this pool or the store) skips
        the store: a Redis round trip on every new prompt's way to its first token. The balancer's
        index may lag behind the store, and such a miss costs a recompute, never a wrong token; the
        pool's own blocks are still matched at admission."""
        if num_cached_blocks_hint <= 0:
            return None
        block_size = self.settings.block_size
        tokens = request.all_token_ids
        hashes = hash_full_blocks(tokens, block_size)[: (len(tokens) - 1) // block_size]  # >= 1 token left
        if not hashes:
            return None
        # Read off the engine thread on purpose (no wait behind a step): only dict/list lookups, and a
        # stale count merely picks the other correct path (the pool's blocks are matched again at admission).
        num_local = self.engine.num_cached_blocks(hashes)
        if num_local == len(hashes):
            return None
        try:
            num_stored = await self.store.lookup(hashes)
            if num_stored <= num_local:
                return None
            data = await self.store.get_blocks(hashes[:num_stored])
        except KvStoreError as exc:
            self.num_prefix_fetch_failures += 1
            log.warning("prefix of %s not fetched (%s): computing it", request.request_id, exc)
            return None
        if data is None:  # evicted or corrupt since the lookup
            self.num_prefix_fetch_failures += 1
            return None
        return data, num_stored * block_size

    def _admit_with_prefix(self, request, kv_data, num_kv_tokens: int) -> bool:
        """Runs on the engine thread: join with the fetched prefix; False when there is no room now."""
        if not self.engine.can_admit(len(request.all_token_ids)):
            return False
        self.engine.add_prefilled(
            request.request_id,
            request.prompt_token_ids,
            request.output_token_ids,
            request.sampling,
            kv_data,
            num_kv_tokens,
            count_as_cached=True,
        )
        self.num_prefix_blocks_reused += kv_data.shape[0]
        return True

    async def after_step(self, outputs: list) -> None:
        await self.publish_outputs(outputs)  # first tokens go out before any KV is copied: TTFT
        if trace.enabled():
            for out in outputs:
                trace.hop(out.request_id, "pw.published")
        pinned = [o for o in outputs if o.finish_reason is None and o.request_id in self.requests]
        prefilled, pool_changes = await self.compute.call(self._take_prefilled, [o.request_id for o in pinned])
        await self.publish_pool_changes(*pool_changes)
        for out in outputs:
            if out.finish_reason is not None:  # done at its first token (max_tokens=1, EOS)
                self.forget(out.request_id)
                await self.settle(out.request_id)
            elif out.request_id in prefilled and out.request_id in self.requests:
                self.spawn(self.hand_off(out.request_id, out.new_token_ids, prefilled[out.request_id]))

    def _take_prefilled(self, request_ids: list[str]) -> tuple[dict, tuple[list[bytes], list[bytes]]]:
        """Runs on the engine thread: each sequence's KV as a CPU copy (its blocks are freed), and
        the pool's prefix-cache changes since the last step."""
        taken = {}
        for request_id in request_ids:
            try:
                taken[request_id] = self.engine.take_prefilled(request_id)
            except KeyError:  # aborted (cancel, newer attempt) since the step
                continue
        return taken, self.engine.drain_kv_events()

    async def publish_pool_changes(self, stored: list[bytes], removed: list[bytes]) -> None:
        """KvEvents (where=<this worker>) for the prefill-balancer's cache-aware routing."""
        now = time.time()
        for kind, hashes in (("removed", removed), ("stored", stored)):
            for start in range(0, len(hashes), MAX_HASHES_PER_EVENT):
                event = KvEvent(
                    kind=kind,
                    kv_namespace=self.namespace,
                    where=self.worker_id,
                    block_hashes=hashes[start : start + MAX_HASHES_PER_EVENT],
                    timestamp=now,
                )
                await self.nc.publish(subjects.KV_EVENTS, encode(event))

    async def hand_off(self, request_id: str, new_token_ids: list[int], kv) -> None:
        request = self.requests[request_id]
        handoff = await self.store_kv(request, new_token_ids, kv)
        accepted = await self.offer(handoff)
        if self.requests.get(request_id) is not request:
            return  # cancelled (or replaced by a newer attempt) meanwhile; that settled it
        if accepted:
            self.num_handoffs += 1
        else:
            await self.publish_error(request, "overloaded", "no decode worker took the sequence", retryable=True)
        self.forget(request_id)
        await self.settle(request_id)

    async def store_kv(self, request, new_token_ids: list[int], kv) -> Handoff:
        """Write the sequence's KV blocks; a store that fails means a hand-off without KV (recompute)."""
        hashes, refs = handoff_blocks(request.all_token_ids, kv.num_tokens, self.settings.block_size, kv.block_hashes)
        num_kv_tokens = kv.num_tokens
        try:
            await self.store.put_blocks(hashes, kv.data)
        except KvStoreError as exc:
            self.num_kv_store_failures += 1
            log.warning("KV of %s not stored (%s): the decode worker will recompute it", request.request_id, exc)
            refs, num_kv_tokens = [], 0
        onward = dataclasses.replace(request, output_token_ids=request.output_token_ids + list(new_token_ids))
        return Handoff(
            request=onward,
            prefill_worker_id=self.worker_id,
            kv_namespace=self.namespace,
            kv_blocks=refs,
            num_kv_tokens=num_kv_tokens,
        )

    async def offer(self, handoff: Handoff) -> bool:
        """Ask the decode-balancers until one accepts, the request is cancelled, or time is up."""
        request_id = handoff.request.request_id
        deadline = time.monotonic() + self.settings.handoff_timeout_s
        delay_s = 0.05
        while True:
            reason = await self._offer_once(handoff)
            if not reason:
                return True
            if request_id in self.cancelled or time.monotonic() + delay_s > deadline:
                log.warning("hand-off of %s not accepted: %s", request_id, reason)
                return False
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, MAX_RETRY_DELAY_S)

    async def _offer_once(self, handoff: Handoff) -> str:
        """'' when accepted, else why not."""
        try:
            reply = await self.nc.request(subjects.HANDOFF, encode(handoff), timeout=HANDOFF_REQUEST_TIMEOUT_S)
            answer = decode(reply.data)
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError):
            return "no decode-balancer answered"
        except ProtocolError as exc:
            return f"unreadable reply: {exc}"
        if isinstance(answer, HandoffReply):
            return "" if answer.accepted else answer.reason or "rejected"
        return f"{getattr(answer, 'code', '?')}: {getattr(answer, 'message', answer)}"

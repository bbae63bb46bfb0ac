"""The prefill worker: prompt in, first token out at once, KV to the store, sequence handed on.

Pulls `PrefillWork` from `ferry.work.prefill.<id>` while its token budget allows; each engine
step's first tokens go to `ferry.out.<gateway>` right away (TTFT), then, while the next step
computes, the sequence's KV blocks are written to the store (`KvStore.put_blocks`) and a
`Handoff` is offered on `ferry.handoff` until a decode-balancer accepts it (`handoff.py`). Only
then is the JetStream message acked, so a prefill worker that dies mid-way leaves its work to be
redone. On SIGTERM it finishes what it holds within the grace period and gives the rest back to
the gateway (`ErrorEvent(worker_lost, retryable)`: resubmitted elsewhere at once).
"""

from __future__ import annotations

import logging
import time

from ferry import metrics
from ferry.bus import trace
from ferry.kvstore import KvStoreError
from ferry.kvstore.index import MAX_HASHES_PER_EVENT
from ferry.protocol import (
    HANDOFF_TOO_LONG,
    Cancel,
    GenerateRequest,
    KvEvent,
    KvPrefetch,
    KvResync,
    PrefillWork,
    encode,
    hash_full_blocks,
    subjects,
)
from ferry_services.worker.base import Worker
from ferry_services.worker.joining import FetchedKV, Joined
from ferry_services.worker.prefetch import Prefetcher

log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    role = "prefill"
    work_type = PrefillWork

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_prefix_blocks_reused = 0
        """Leading prompt blocks fetched from the store instead of computed."""
        self.num_prefix_fetch_failures = 0
        self.prefetcher = Prefetcher(self)
        self.service.subscribe(
            subjects.kv_prefetch(self.worker_id), KvPrefetch, self.prefetcher.offer, name="kv_prefetch"
        )
        self.service.subscribe(subjects.KV_RESYNC, KvResync, self.on_resync, name="kv_resync")
        self.prefix_blocks_by_tier = {"device": 0, "host": 0, "remote": 0, "computed": 0}
        """Leading full prompt blocks of admitted prompts, by where they came from (a hit rate per tier)."""

    async def start(self, consumer=None) -> None:
        await super().start(consumer)
        await self.publish_pool_contents(cleared=True)

    async def publish_pool_contents(self, cleared: bool = False) -> None:
        """Everything the pool and the host tier hold, as 'stored' events (after 'cleared' ones when
        `cleared`: a restarted worker's balancers forget what its previous life held)."""
        now = time.time()
        if cleared:
            for tier in ("device", "host"):
                event = KvEvent("cleared", self.namespace, self.worker_id, timestamp=now, tier=tier)
                await self.nc.publish(subjects.KV_EVENTS, encode(event))
        device, host = await self.compute.call(self.engine.cached_hashes)
        await self.publish_pool_changes((device, []), (host, []))

    async def on_resync(self, request: KvResync) -> None:
        """A prefill-balancer (re)started with an empty index: tell it everything held here."""
        await self.publish_pool_contents()

    def background(self) -> list:
        return [*super().background(), self.prefetcher.run()]

    async def on_cancel(self, cancel: Cancel) -> None:
        self.prefetcher.cancel(cancel.request_ids)
        await super().on_cancel(cancel)

    def pull_budget(self) -> int:
        ahead = max(self.settings.pull_ahead_tokens, self.settings.max_batch_tokens)
        if self.compute.stats.num_queued_prefill_tokens + self.num_joining_tokens >= ahead:
            return 0  # the next steps are full already: the rest waits in JetStream (FERRY_PULL_AHEAD_TOKENS)
        return super().pull_budget()

    async def fetch_kv(self, work: PrefillWork) -> FetchedKV | None:
        request = work.request
        if work.routed_at:
            log.debug("%s pulled %.1f ms after routing", request.request_id, (time.time() - work.routed_at) * 1000)
        metrics.PREFIX_CACHE_QUERIES.labels(self.role).inc(len(request.all_token_ids))
        tokens = request.all_token_ids
        hashes = hash_full_blocks(tokens, self.settings.block_size)[: (len(tokens) - 1) // self.settings.block_size]
        await self.prefetcher.settle(request.request_id, hashes)
        trace.hop(request.request_id, "pw.settled")
        prefix = await self.fetch_prefix(request, work.num_cached_blocks_hint, hashes)
        trace.hop(request.request_id, "pw.prefix")
        return prefix

    async def fetch_prefix(
        self, request: GenerateRequest, num_cached_blocks_hint: int = 1, hashes: list[bytes] | None = None
    ) -> FetchedKV | None:
        """The prompt's leading full blocks from the store, when the store holds more of them than
        this worker's own pool; None to compute (or hit locally) instead.

        A hint of 0 (the balancer knows of no block of this prompt in this pool or the store) skips
        the store: a Redis round trip on every new prompt's way to its first token. The balancer's
        index may lag behind the store, and such a miss costs a recompute, never a wrong token; the
        pool's own blocks are still matched at admission."""
        block_size = self.settings.block_size
        tokens = request.all_token_ids
        if hashes is None:
            hashes = hash_full_blocks(tokens, block_size)[: (len(tokens) - 1) // block_size]  # >= 1 token left
        # Read off the engine thread on purpose (no wait behind a step): only dict/list lookups, and a
        # stale count merely picks the other correct path (pool and host blocks are matched again at admission).
        num_device, num_host = self.engine.cached_tiers(hashes)
        num_local = num_device + num_host
        data = None
        if num_cached_blocks_hint > 0 and num_local < len(hashes):
            data = await self.fetch_from_store(request, hashes, num_local)
        num_remote = data.shape[0] - num_local if data is not None else 0
        self.count_prefix_tiers(len(hashes), num_device, num_host, num_remote)
        if data is None:
            return None  # staged here: the copy to the device overlaps the engine's steps
        return FetchedKV(self.engine.stage_kv(data), data.shape[0] * block_size)

    async def fetch_from_store(self, request: GenerateRequest, hashes: list[bytes], num_local: int):
        """[n, *block_shape] of the leading blocks when the store holds more of them than this
        worker has locally; None otherwise (and when the store fails: the blocks are computed)."""
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
        return data

    def count_prefix_tiers(self, num_blocks: int, num_device: int, num_host: int, num_remote: int) -> None:
        tiers = self.prefix_blocks_by_tier
        tiers["device"] += num_device
        tiers["host"] += num_host
        tiers["remote"] += num_remote
        tiers["computed"] += num_blocks - num_device - num_host - num_remote

    def count_join(self, request: GenerateRequest, joined: Joined, kv: FetchedKV | None) -> None:
        if joined is Joined.WITH_KV:
            assert kv is not None
            self.num_prefix_blocks_reused += kv.data.shape[0]

    async def after_step(self, outputs: list) -> None:
        await self.publish_outputs(outputs)  # first tokens go out before any KV is copied: TTFT
        owners = {out.request_id: self.ledger.owner(out.request_id) for out in outputs}
        if trace.enabled():
            for request in filter(None, owners.values()):
                trace.hop(request.request_id, "pw.published")
        pinned = [o.request_id for o in outputs if o.finish_reason is None and owners[o.request_id] is not None]
        prefilled, pool_changes = await self.compute.call(self._take_prefilled, pinned)
        await self.publish_pool_changes(*pool_changes)
        for out in outputs:
            request = owners[out.request_id]
            if out.finish_reason is not None:  # done at its first token (max_tokens=1, EOS)
                await self.apply(self.ledger.finished(out.request_id))
            elif out.request_id in prefilled and request is not None and self.ledger.is_current(request):
                self.ledger.left_engine(request)
                self.spawn(self.hand_off(request, out.new_token_ids, prefilled[out.request_id]))

    def _take_prefilled(self, sequence_ids: list[str]) -> tuple[dict, tuple]:
        """Runs on the engine thread: each sequence's KV as a CPU copy (its blocks are freed), and
        the pool's and the host tier's block changes since the last step."""
        taken = {}
        for sequence_id in sequence_ids:
            try:
                taken[sequence_id] = self.engine.take_prefilled(sequence_id)
            except KeyError:  # aborted (cancel, newer attempt) since the step
                continue
        return taken, (self.engine.drain_kv_events(), self.engine.drain_host_events())

    async def publish_pool_changes(self, device: tuple[list[bytes], list[bytes]], host=([], [])) -> None:
        """KvEvents (where=<this worker>) of its pool ('device') and host tier ('host'), each a
        (stored, removed) pair, for the prefill-balancer's cache-aware routing."""
        now = time.time()
        for tier, (stored, removed) in (("device", device), ("host", host)):
            for kind, hashes in (("removed", removed), ("stored", stored)):
                for start in range(0, len(hashes), MAX_HASHES_PER_EVENT):
                    event = KvEvent(
                        kind=kind,
                        kv_namespace=self.namespace,
                        where=self.worker_id,
                        block_hashes=hashes[start : start + MAX_HASHES_PER_EVENT],
                        timestamp=now,
                        tier=tier,
                    )
                    await self.nc.publish(subjects.KV_EVENTS, encode(event))

    async def hand_off(self, request: GenerateRequest, new_token_ids: list[int], kv) -> None:
        """KV to the store, the sequence to a decode worker; only then is the message acked."""
        refusal = await self.handoffs.send(request, new_token_ids, kv, self.settings.handoff_timeout_s)
        if not self.ledger.is_current(request):
            return  # cancelled (or replaced by a newer attempt) meanwhile; that settled it
        if refusal.startswith(HANDOFF_TOO_LONG):  # retrying (or migrating) cannot help: the client's to shorten
            await self.publish_error(request, "bad_request", f"no decode worker can hold it ({refusal})", False)
        elif refusal:
            await self.publish_error(request, "overloaded", "no decode worker took the sequence", retryable=True)
        await self.apply(self.ledger.done(request))

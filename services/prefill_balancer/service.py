"""prefill-balancer: places each new request on a prefill worker.

Reads `ferry.submit` (request/reply, queue group `prefill-balancer`: replicas share the load),
`ferry.load.prefill.*` and `ferry.kv.events`; writes `ferry.work.prefill.<worker>` (JetStream
FERRY_WORK) and, just before, `ferry.kv.prefetch.<worker>` (`KvPrefetch` of the prompt's blocks only
the store holds, FERRY_KV_PREFETCH). On start it asks (`ferry.kv.resync`) the prefill workers and the
kvcache service to republish what they hold, so a restarted replica rebuilds its index at once. When a
prefill worker restarts (its 'cleared' event: pool and host tier gone), the chains of the latest turn-end
warm-ups (recent_chains.py) are warmed up again as soon as it reports, so conversations in their think time
still find their history local.
Replies `SubmitReply`: accepted with the worker id, or rejected with 'overloaded' (+ retry_after_s)
or 'no_workers'. Queued work of a prefill worker that falls silent is moved to
live workers. Every input is counted in `nats micro stats prefill-balancer`: `submit`, `load`,
`kv_events`, `reroute`. The policy is policy.py and prefix_index.py; the rest is `ferry.balancing`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client

from ferry.balancing.balancer import Balancer, serve_balancer
from ferry.bus import trace
from ferry.protocol import (
    KvEvent,
    KvPrefetch,
    KvResync,
    KvWarm,
    PrefillWork,
    SubmitReply,
    SubmitRequest,
    encode,
    hash_full_blocks,
    subjects,
)
from ferry_services.prefill_balancer.policy import (
    PrefillChoice,
    PrefillPolicyConfig,
    choose_prefill_worker,
    next_mean_prompt_tokens,
)
from ferry_services.prefill_balancer.prefix_index import STORE, PrefixIndex, PrefixIndexConfig
from ferry_services.prefill_balancer.recent_chains import RecentChains
from ferry_services.prefill_balancer.settings import PrefillBalancerSettings

log = logging.getLogger(__name__)

REWARM_WAIT_S = 60.0
"""Most a re-warm waits for a restarted worker's first load report (its engine may take a while to load)."""


class PrefillBalancer(Balancer[PrefillWork]):
    name = "prefill-balancer"
    role = "prefill"
    work_type = PrefillWork
    description = "places requests on prefill workers"

    def __init__(self, nc: Client, settings: PrefillBalancerSettings) -> None:
        super().__init__(nc, settings)
        self.settings = settings
        self.config = PrefillPolicyConfig(
            max_queued_tokens=settings.max_queued_tokens,
            attention_weight=settings.attention_weight,
            retry_after_s=settings.retry_after_s,
        )
        self.mean_prompt_tokens = 0.0
        self.num_prefetches = 0
        self.prefixes = PrefixIndex(
            PrefixIndexConfig(
                device_weight=settings.device_tier_weight,
                host_weight=settings.host_tier_weight,
                remote_weight=settings.remote_tier_weight,
            )
        )
        self.service.endpoint(subjects.SUBMIT, SubmitRequest, self.submit, queue=subjects.SUBMIT_QUEUE, name="submit")
        self.service.subscribe(subjects.KV_EVENTS, KvEvent, self.on_kv_event, name="kv_events")
        self.service.subscribe(subjects.KV_WARM, KvWarm, self.on_warm, queue=subjects.KV_WARM_QUEUE, name="kv_warm")
        self.num_warmups = 0
        self.recent_chains = RecentChains()
        self.num_rewarmed = 0
        """Warm-ups replayed into restarted workers."""
        self._rewarms: dict[str, asyncio.Task] = {}

    async def on_serving(self) -> None:
        """Ask every prefill worker and the kvcache service to republish what they hold: a
        (re)started replica's index is rebuilt from them, not only from whatever events come next."""
        await self.nc.publish(subjects.KV_RESYNC, encode(KvResync(requester=self.service.id)))

    async def on_kv_event(self, event: KvEvent) -> None:
        """A pool's or the store's blocks changed (bad events are counted and logged by the service)."""
        self.prefixes.apply(event.kind, event.kv_namespace, event.where, event.block_hashes, event.tier)
        if event.kind == "cleared" and event.where != STORE and event.tier == "device" and self.settings.kv_prefetch:
            # a worker (re)started: what its host tier held for conversations in their think time is gone
            running = self._rewarms.pop(event.where, None)
            if running is not None:
                running.cancel()
            self._rewarms[event.where] = asyncio.create_task(self.rewarm(event.where, event.kv_namespace))

    async def rewarm(self, worker_id: str, namespace: str) -> None:
        """Once the restarted worker reports (it is routable again), replay the recent warm-ups of its
        namespace, oldest first (its bounded warm-up queue keeps the newest): each goes where the next
        turn would be routed now, which skips chains warm elsewhere."""
        try:
            cleared_at = time.monotonic()
            deadline = cleared_at + REWARM_WAIT_S
            while not self._reported_since(worker_id, cleared_at):
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.05)
            for request_id, chain in self.recent_chains.of(namespace):
                partial = self.recent_chains.partial(namespace, chain)
                self.num_rewarmed += await self.warm_chain(request_id, namespace, chain, partial)
        finally:
            if self._rewarms.get(worker_id) is asyncio.current_task():
                del self._rewarms[worker_id]

    def _reported_since(self, worker_id: str, since: float) -> bool:
        state = self.runtime.view.workers.get(worker_id)
        return state is not None and state.received_at >= since and not state.report.draining

    async def stop(self) -> None:
        for task in self._rewarms.values():
            task.cancel()
        await asyncio.gather(*self._rewarms.values(), return_exceptions=True)
        await super().stop()

    async def on_warm(self, warm: KvWarm) -> None:
        """A turn ended and its blocks are in the store: have them fetched, while the user thinks, into
        the worker that the next turn (this chain + a new message) would be routed to now (session
        affinity through the prefix index: the one holding the chain's head, unless it is too busy)."""
        if not self.settings.kv_prefetch:
            return
        written = warm.block_hashes + ([warm.partial_hash] if warm.partial_hash else [])
        self.prefixes.apply("stored", warm.kv_namespace, STORE, written)  # before the store's own events
        self.recent_chains.add(warm.request_id, warm.kv_namespace, warm.block_hashes, warm.partial_hash)
        await self.warm_chain(warm.request_id, warm.kv_namespace, warm.block_hashes, warm.partial_hash)

    async def warm_chain(
        self, request_id: str, namespace: str, chain: list[bytes], partial: bytes | None = None
    ) -> int:
        """Have the worker the chain's next turn would be routed to now fetch the blocks of it it lacks
        (and the chain's partial last block: the next turn extends it); 1 when a warm-up was sent, else 0."""
        states = [s for s in self.runtime.view.routable(time.monotonic()) if s.report.kv_namespace == namespace]
        if not states:
            return 0
        block_size = states[0].report.block_size
        cached = self.prefixes.cached_tokens({s.worker_id: namespace for s in states}, chain, block_size)
        choice = choose_prefill_worker(states, len(chain) * block_size, self.config, cached, self.mean_prompt_tokens)
        if choice.worker_id is None:
            return 0
        missing = self.prefixes.not_held(namespace, choice.worker_id, chain + ([partial] if partial else []))
        if not missing:
            return 0
        missing = missing[: self.settings.max_prefetch_blocks]
        self.prefixes.apply("stored", namespace, choice.worker_id, missing, tier="host")  # there in a moment
        self.num_warmups += 1
        if partial is not None and missing == [partial]:
            # also the full block it follows (held there: the fetch skips it): the next turn's admission
            # matches a warm-up to its prompt by full blocks (Prefetcher.settle), and waits for this one
            missing = [chain[-1], partial]
        prefetch = KvPrefetch(f"warm-{request_id}", namespace, missing, warm=True)
        await self.nc.publish(subjects.kv_prefetch(choice.worker_id), encode(prefetch))
        return 1

    def choose(self, token_ids: list[int], model: str) -> tuple[PrefillChoice, KvPrefetch | None]:
        """Where the prompt goes, and what to prefetch there (blocks only the store holds)."""
        states = self.runtime.view.routable(time.monotonic(), model)
        block_size = states[0].report.block_size if states else 1  # one block size per deployment
        hashes = hash_full_blocks(token_ids, block_size)[: (len(token_ids) - 1) // block_size] if states else []
        cached = self.prefixes.cached_tokens({s.worker_id: s.report.kv_namespace for s in states}, hashes, block_size)
        choice = choose_prefill_worker(
            states, len(token_ids), self.config, cached, mean_prompt_tokens=self.mean_prompt_tokens
        )
        prefetch = None
        if choice.worker_id is not None:
            self.runtime.view.note_routed(choice.worker_id, tokens=choice.cost.tokens, attention=choice.cost.attention)
            namespace = next(s for s in states if s.worker_id == choice.worker_id).report.kv_namespace
            if self.settings.kv_prefetch:
                missing = self.prefixes.only_in_store(namespace, choice.worker_id, hashes)
                if missing:  # request_id is filled in by the caller
                    prefetch = KvPrefetch("", namespace, missing[: self.settings.max_prefetch_blocks])
            # it will hold these blocks in a moment: the next same-prefix request sees them there
            self.prefixes.apply("stored", namespace, choice.worker_id, hashes)
        return choice, prefetch

    async def send_prefetch(self, worker_id: str, request_id: str, prefetch: KvPrefetch | None) -> None:
        """Ahead of the work itself: the worker starts fetching while the request is still queued."""
        if prefetch is None:
            return
        prefetch.request_id = request_id
        self.num_prefetches += 1
        await self.nc.publish(subjects.kv_prefetch(worker_id), encode(prefetch))

    def cached_blocks_hint(self, choice: PrefillChoice) -> int:
        """Rounded up, so that 0 means "no block of this prompt known in the worker's pool or the
        store": the worker then skips its store lookup (a Redis round trip before the first token)."""
        block_size = self.runtime.view.workers[choice.worker_id].report.block_size
        return -(-choice.num_cached_tokens // block_size)

    def routing_share(self, num_pending: int, model: str) -> int:
        """One routable worker's share of `num_pending` submits, rounded up (the routing spreads a burst)."""
        num_workers = max(1, len(self.runtime.view.routable(time.monotonic(), model)))
        return -(-num_pending // num_workers)

    async def submit(self, submit: SubmitRequest) -> SubmitReply:
        request = submit.request
        trace.hop(request.request_id, "pb.submit")
        choice, prefetch = self.choose(request.all_token_ids, request.model)
        if choice.worker_id is None:
            return SubmitReply(request.request_id, False, reason=choice.reason, retry_after_s=choice.retry_after_s)
        self.arrivals.observe(len(request.all_token_ids), request.sampling.max_tokens)
        self.mean_prompt_tokens = next_mean_prompt_tokens(
            self.mean_prompt_tokens, len(request.all_token_ids), self.config
        )
        work = PrefillWork(request, routed_at=time.time(), num_cached_blocks_hint=self.cached_blocks_hint(choice))
        await self.send_prefetch(choice.worker_id, request.request_id, prefetch)
        # the submits queued behind this one (a burst still being routed) tell the worker's admission
        # window to hold an idle engine's first step for them (services/worker/window.py): this worker's
        # share of them, rounded up, so that with several workers an idle one does not hold its first step
        # for prompts that go to the others
        work.num_routing_behind = self.routing_share(self.service.num_pending("submit"), request.model)
        trace.hop(request.request_id, "pb.routed", behind=work.num_routing_behind)
        await self.runtime.publish_work(choice.worker_id, work)
        return SubmitReply(request.request_id, True, worker_id=choice.worker_id)

    async def reroute(self, work: PrefillWork) -> bool:
        """Move one message of a silent worker's queue to a live worker."""
        choice, prefetch = self.choose(work.request.all_token_ids, work.request.model)
        if choice.worker_id is None:
            return False
        await self.send_prefetch(choice.worker_id, work.request.request_id, prefetch)
        work.routed_at = time.time()
        work.num_cached_blocks_hint = self.cached_blocks_hint(choice)
        work.num_routing_behind = 0  # not part of a burst being routed now
        await self.runtime.publish_work(choice.worker_id, work)
        log.info("re-routed request %s to prefill worker %s", work.request.request_id, choice.worker_id)
        return True


async def serve(settings: PrefillBalancerSettings) -> int:
    """Run one prefill-balancer until SIGTERM/SIGINT; the exit status."""
    return await serve_balancer(PrefillBalancer, settings)

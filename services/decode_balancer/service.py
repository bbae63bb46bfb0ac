"""decode-balancer: places each prefilled sequence on a decode worker.

Reads `ferry.handoff` (request/reply, queue group `decode-balancer`), `ferry.load.decode.*` and
`ferry.kv.warm` (every replica: a finished turn's chain and the decode worker that holds it, for session
affinity, affinity.py);
writes `ferry.work.decode.<worker>` (JetStream FERRY_WORK). Replies `HandoffReply`: accepted with
the worker id, or rejected ('overloaded': every worker at its batch cap or out of KV blocks;
'no_workers') so the prefill worker keeps the sequence and retries. Queued hand-offs of a decode
worker that falls silent are moved to live workers. Every input is counted in `nats micro stats
decode-balancer`: `handoff`, `load`, `kv_warm`, `reroute`. The policy is policy.py; the rest is `ferry.balancing`.
"""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client

from ferry.balancing.balancer import Balancer, serve_balancer
from ferry.protocol import Handoff, HandoffReply, KvWarm, subjects
from ferry_services.decode_balancer.affinity import SessionAffinity
from ferry_services.decode_balancer.policy import DecodeChoice, DecodePolicyConfig, choose_decode_worker
from ferry_services.decode_balancer.settings import DecodeBalancerSettings

log = logging.getLogger(__name__)


class DecodeBalancer(Balancer[Handoff]):
    name = "decode-balancer"
    role = "decode"
    work_type = Handoff
    description = "places prefilled sequences on decode workers"

    def __init__(self, nc: Client, settings: DecodeBalancerSettings) -> None:
        super().__init__(nc, settings)
        self.config = DecodePolicyConfig(
            kv_weight=settings.kv_weight,
            seqs_weight=settings.seqs_weight,
            affinity_weight=settings.affinity_weight,
            retry_after_s=settings.retry_after_s,
        )
        self.affinity = SessionAffinity()
        self._started_at: dict[str, float] = {}
        """Per decode worker, the `started_at` of its last report seen here."""
        self.service.endpoint(subjects.HANDOFF, Handoff, self.handoff, queue=subjects.HANDOFF_QUEUE, name="handoff")
        self.service.subscribe(subjects.KV_WARM, KvWarm, self.on_warm, name="kv_warm")  # no queue: every replica

    async def on_warm(self, warm: KvWarm) -> None:
        """A turn ended: the worker that decoded it holds the conversation's whole chain, the head of the
        next turn's, so that turn is credited there (its prefill-balancer warm-up goes to a prefill worker)."""
        if warm.worker_id:
            self.affinity.note(warm.worker_id, warm.block_hashes)

    def choose(self, handoff: Handoff) -> DecodeChoice:
        states = self.runtime.view.routable(time.monotonic(), handoff.request.model)
        self.forget_restarted(states)
        chain = full_blocks(handoff)
        shares = self.affinity.shares([s.worker_id for s in states], chain)
        choice = choose_decode_worker(states, handoff.num_kv_tokens, self.config, shares)
        if choice.worker_id is not None:
            self.runtime.view.note_routed(choice.worker_id, blocks=choice.num_blocks)
            self.affinity.note(choice.worker_id, chain)  # it will hold them in a moment
        return choice

    def forget_restarted(self, states) -> None:
        """A worker whose report says it started anew holds none of the chains noted for it: no credit there."""
        for state in states:
            started_at = state.report.started_at
            if self._started_at.setdefault(state.worker_id, started_at) != started_at:
                self._started_at[state.worker_id] = started_at
                self.affinity.forget(state.worker_id)
                log.info("decode worker %s restarted: its session affinity is forgotten", state.worker_id)

    async def handoff(self, handoff: Handoff) -> HandoffReply:
        request_id = handoff.request.request_id
        choice = self.choose(handoff)
        if choice.worker_id is None:
            return HandoffReply(request_id, False, reason=choice.reason)
        handoff.decode_worker_id = choice.worker_id
        self.arrivals.observe(handoff.num_kv_tokens, handoff.request.sampling.max_tokens)
        await self.runtime.publish_work(choice.worker_id, handoff)
        return HandoffReply(request_id, True, worker_id=choice.worker_id)

    async def reroute(self, handoff: Handoff) -> bool:
        """Move one hand-off of a silent worker's queue to a live worker."""
        if (await self.handoff(handoff)).accepted:
            log.info("re-routed hand-off %s to decode worker %s", handoff.request.request_id, handoff.decode_worker_id)
            return True
        return False


def full_blocks(handoff: Handoff) -> list[bytes]:
    """The hand-off's full blocks (a trailing partial one is keyed apart and never recurs)."""
    refs = handoff.kv_blocks
    if refs and refs[-1].num_tokens < refs[0].num_tokens:
        refs = refs[:-1]
    return [ref.block_hash for ref in refs]


async def serve(settings: DecodeBalancerSettings) -> int:
    """Run one decode-balancer until SIGTERM/SIGINT; the exit status."""
    return await serve_balancer(DecodeBalancer, settings)

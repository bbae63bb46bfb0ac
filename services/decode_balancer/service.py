"""decode-balancer: places each prefilled sequence on a decode worker.

Reads `ferry.handoff` (request/reply, queue group `decode-balancer`) and `ferry.load.decode.*`;
writes `ferry.work.decode.<worker>` (JetStream FERRY_WORK). Replies `HandoffReply`: accepted with
the worker id, or rejected ('overloaded': every worker at its batch cap or out of KV blocks;
'no_workers') so the prefill worker keeps the sequence and retries. Queued hand-offs of a decode
worker that falls silent are moved to live workers. Every input is counted in `nats micro stats
decode-balancer`: `handoff`, `load`, `reroute`. The policy is policy.py; the rest is `ferry.balancing`.
"""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client

from ferry.balancing.balancer import Balancer, serve_balancer
from ferry.protocol import Handoff, HandoffReply, subjects
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
            kv_weight=settings.kv_weight, seqs_weight=settings.seqs_weight, retry_after_s=settings.retry_after_s
        )
        self.service.endpoint(subjects.HANDOFF, Handoff, self.handoff, queue=subjects.HANDOFF_QUEUE, name="handoff")

    def choose(self, handoff: Handoff) -> DecodeChoice:
        states = self.runtime.view.routable(time.monotonic(), handoff.request.model)
        choice = choose_decode_worker(states, handoff.num_kv_tokens, self.config)
        if choice.worker_id is not None:
            self.runtime.view.note_routed(choice.worker_id, blocks=choice.num_blocks)
        return choice

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


async def serve(settings: DecodeBalancerSettings) -> int:
    """Run one decode-balancer until SIGTERM/SIGINT; the exit status."""
    return await serve_balancer(DecodeBalancer, settings)

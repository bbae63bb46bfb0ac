"""decode-balancer: places each prefilled sequence on a decode worker.

Reads `ferry.handoff` (request/reply, queue group `decode-balancer`) and `ferry.load.decode.*`;
writes `ferry.work.decode.<worker>` (JetStream FERRY_WORK). Replies `HandoffReply`: accepted with
the worker id, or rejected ('overloaded': every worker at its batch cap or out of KV blocks;
'no_workers') so the prefill worker keeps the sequence and retries. Queued hand-offs of a decode
worker that falls silent are moved to live workers.
"""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client

from ferry.bus import Service, connect, ensure_work_stream, run_service
from ferry.metrics import start_metrics_server
from ferry.protocol import Handoff, HandoffReply, ProtocolError, decode, subjects
from ferry_services.decode_balancer.policy import DecodeChoice, DecodePolicyConfig, choose_decode_worker
from ferry_services.decode_balancer.settings import DecodeBalancerSettings
from ferry_services.prefill_balancer.runtime import BalancerRuntime

log = logging.getLogger(__name__)


class DecodeBalancer:
    def __init__(self, nc: Client, settings: DecodeBalancerSettings) -> None:
        self.config = DecodePolicyConfig(
            kv_weight=settings.kv_weight, seqs_weight=settings.seqs_weight, retry_after_s=settings.retry_after_s
        )
        self.runtime = BalancerRuntime(
            nc, "decode", silent_after_intervals=settings.silent_after_intervals, tick_s=settings.tick_s
        )
        self.service = Service("decode-balancer", description="places prefilled sequences on decode workers")
        self.service.endpoint(subjects.HANDOFF, Handoff, self.handoff, queue=subjects.HANDOFF_QUEUE)
        self.nc = nc

    async def start(self) -> None:
        await self.runtime.start(self.reroute)
        await self.service.start(self.nc)

    async def stop(self) -> None:
        await self.service.stop()
        await self.runtime.stop()

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
        await self.runtime.publish_work(choice.worker_id, handoff)
        return HandoffReply(request_id, True, worker_id=choice.worker_id)

    async def reroute(self, data: bytes) -> bool:
        """Move one hand-off of a silent worker's queue to a live worker."""
        try:
            handoff = decode(data, Handoff)
        except ProtocolError as exc:
            log.error("dropping an unreadable message from a silent worker's queue: %s", exc)
            return True
        if (await self.handoff(handoff)).accepted:
            log.info("re-routed hand-off %s to decode worker %s", handoff.request.request_id, handoff.decode_worker_id)
            return True
        return False


async def serve(settings: DecodeBalancerSettings) -> int:
    """Run one decode-balancer until SIGTERM/SIGINT; the exit status."""
    nc = await connect(settings.nats_url, "decode-balancer")
    await ensure_work_stream(nc.jetstream(), replicas=settings.work_replicas)
    balancer = DecodeBalancer(nc, settings)
    await balancer.runtime.start(balancer.reroute)
    start_metrics_server(settings.metrics_port)
    return await run_service(nc, balancer.service, on_shutdown=balancer.runtime.stop)

"""The gateway's side of NATS: submit, cancel, and the two subscriptions it listens on.

Reads `ferry.out.<gateway_id>` (OutputBatch -> RequestTracker) and `ferry.load.>` (LoadReport ->
LiveWorkers); writes `ferry.submit` (request/reply), `ferry.cancel` and, every
FERRY_FORECAST_PUBLISH_S, `ferry.forecast.gateway-<gateway_id>` (TrafficForecast: traffic.py).
Registered with NATS micro as service `gateway`, so `nats micro ls` shows every gateway replica
and its subscriptions.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from ferry.bus import Service, connect, drain_or_close, trace
from ferry.protocol import (
    Cancel,
    ErrorReply,
    GenerateRequest,
    LoadReport,
    OutputBatch,
    ProtocolError,
    SubmitReply,
    SubmitRequest,
    decode,
    encode,
    subjects,
)
from ferry.sched import BatchWhenBusy
from ferry_services.gateway.tracker import RequestTracker
from ferry_services.gateway.traffic import GatewayTraffic
from ferry_services.gateway.workers import LiveWorkers

log = logging.getLogger("ferry.gateway")


class SubmitFailed(Exception):
    """The balancer did not take the request: (code, message), code as in SubmitReply.reason."""

    def __init__(self, code: str, message: str, retry_after_s: float = 0.0, maybe_accepted: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.maybe_accepted = maybe_accepted
        """The answer was lost, not a refusal: the request may be running and needs a cancel."""


class GatewayBus:
    def __init__(
        self,
        gateway_id: str,
        submit_timeout_s: float = 5.0,
        traffic: GatewayTraffic | None = None,
        sched_batch_from: int = 0,
    ) -> None:
        self.gateway_id = gateway_id
        self.submit_timeout_s = submit_timeout_s
        self.traffic = traffic or GatewayTraffic(gateway_id)
        """Arrivals, their forecast (published from start() on) and SLO outcomes: traffic.py."""
        self._publisher: asyncio.Task | None = None
        self.tracker = RequestTracker()
        self.busy = BatchWhenBusy(sched_batch_from)
        """The event loop thread's scheduling policy, by the streams open (ferry.sched)."""
        self.workers = LiveWorkers()
        self._nc: Client | None = None
        self._service = Service(
            "gateway", description="OpenAI-compatible HTTP gateway", metadata={"gateway_id": gateway_id}
        )
        self._service.subscribe(subjects.out(gateway_id), OutputBatch, self._on_output, name="output")
        self._service.subscribe(subjects.LOAD_ALL, LoadReport, self._on_load, name="load")

    @property
    def num_reconnects(self) -> int:
        """Times the NATS connection was re-established (events may have been missed meanwhile)."""
        return self._nc.stats["reconnects"] if self._nc is not None else 0

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def start(self, nats_url: str, connect_timeout_s: float = 30.0) -> None:
        self._nc = await connect(nats_url, f"gateway-{self.gateway_id}", connect_timeout_s=connect_timeout_s)
        await self._service.start(self._nc)
        self._publisher = asyncio.create_task(self.traffic.publish_loop(self._nc))

    async def stop(self) -> None:
        """Drain (cancels already published still go out); just close if the server is gone."""
        if self._nc is None:
            return
        nc, self._nc = self._nc, None
        if self._publisher is not None:
            self._publisher.cancel()
        await self._service.stop()
        await drain_or_close(nc)

    async def _on_output(self, batch: OutputBatch) -> None:
        if trace.enabled():
            for event in batch.tokens:
                if event.index == 0:
                    trace.hop(event.request_id, "gw.event")
        self.tracker.deliver(batch)
        self.busy.update(len(self.tracker))

    async def _on_load(self, report: LoadReport) -> None:
        now = time.monotonic()
        self.workers.observe(report, now)
        self.workers.forget_stale(now)

    async def submit(self, request: GenerateRequest) -> SubmitReply:
        """Hand the request to a prefill-balancer; raises SubmitFailed unless it was accepted."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            raise SubmitFailed("no_workers", "the gateway is not connected to the message bus")
        try:
            msg = await nc.request(
                subjects.SUBMIT, encode(SubmitRequest(request=request)), timeout=self.submit_timeout_s
            )
        except NoRespondersError:
            raise SubmitFailed("no_workers", "no prefill-balancer is running") from None
        except NatsTimeoutError:
            raise SubmitFailed(
                "no_workers", f"the prefill-balancer did not answer in {self.submit_timeout_s:g}s", maybe_accepted=True
            ) from None
        return _accepted(decode_reply(msg.data))

    async def cancel(self, request_ids: list[str], reason: str, below_attempt: int | None = None) -> None:
        """Cancel every attempt, or (below_attempt=n) only the stale copies older than attempt n."""
        nc = self._nc
        if nc is None or not nc.is_connected or not request_ids:
            return
        try:
            await nc.publish(
                subjects.CANCEL, encode(Cancel(request_ids=request_ids, reason=reason, below_attempt=below_attempt))
            )
        except Exception:  # closing connection: workers time the request out on their own
            log.warning("could not publish cancel for %s", request_ids, exc_info=True)


def decode_reply(data: bytes) -> SubmitReply | ErrorReply:
    try:
        reply = decode(data)
    except ProtocolError as exc:
        raise SubmitFailed("internal", f"bad reply from the prefill-balancer: {exc}") from None
    if not isinstance(reply, (SubmitReply, ErrorReply)):
        raise SubmitFailed("internal", f"unexpected {type(reply).__name__} from the prefill-balancer")
    return reply


def _accepted(reply: SubmitReply | ErrorReply) -> SubmitReply:
    if isinstance(reply, ErrorReply):
        raise SubmitFailed(reply.code, reply.message)
    if not reply.accepted:
        raise SubmitFailed(reply.reason or "rejected", reply.reason or "rejected", reply.retry_after_s)
    return reply

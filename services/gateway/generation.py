"""One request's life on the bus: admission, submit, token events with a timeout, cancel.

`Generation.close()` always runs (the HTTP layer guarantees it) and publishes `ferry.cancel`
unless the request finished, so a client that goes away, a timeout or a downstream error frees
the request's KV blocks on every worker holding it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ferry import metrics
from ferry.bus import trace
from ferry.protocol import ErrorEvent, GenerateRequest, TokenEvent
from ferry_services.gateway.bus import GatewayBus, SubmitFailed
from ferry_services.gateway.errors import APIError
from ferry_services.gateway.migration import WATCH_INTERVAL_S, LossWatch, migrate
from ferry_services.gateway.tracker import Event, Lost

# ErrorEvent.code / SubmitReply.reason -> HTTP status
_STATUS = {
    "overloaded": 429,
    "no_workers": 503,
    "bad_request": 400,
    "worker_lost": 503,
    "kv_transfer": 503,
    "internal": 500,
}


def downstream_error(code: str, message: str, retry_after_s: float) -> APIError:
    status = _STATUS.get(code, 503)
    return APIError(
        status,
        message if message != code else f"request rejected: {code}",
        code=code,
        retry_after_s=retry_after_s if status == 429 else None,
    )


def check_inflight(bus: GatewayBus, max_inflight: int, retry_after_s: float) -> None:
    """The 429 of a full gateway. The HTTP layer calls it before tokenizing too, so that a gateway
    at its limit turns requests away without spending milliseconds of its loop on each prompt."""
    if len(bus.tracker) >= max_inflight:
        raise APIError(
            429,
            f"the gateway has {max_inflight} requests in flight; retry later",
            code="overloaded",
            retry_after_s=retry_after_s,
        )


class Generation:
    def __init__(self, bus: GatewayBus, request: GenerateRequest, timeout_s: float, max_attempts: int = 3) -> None:
        self.bus = bus
        self.request = request
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self._watch = LossWatch(bus, request.request_id)
        self.is_finished = False
        self._queue: asyncio.Queue[Event] | None = None
        self._cancel_reason = "client_disconnected"
        self._accepted_at = 0.0
        self._last_event_at = 0.0
        self._first_event_at = 0.0
        self._num_tokens = 0
        self._retry_after_s = 1.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def start(self, max_inflight: int, retry_after_s: float, now: float) -> None:
        """Admit and submit, or raise the APIError the client should get (429, 503, ...)."""
        self._retry_after_s = retry_after_s
        check_inflight(self.bus, max_inflight, retry_after_s)
        if not self.bus.is_connected:
            raise APIError(503, "the gateway is not connected to the message bus", code="bus_unavailable")
        missing = self.bus.workers.missing_roles(now)
        if missing:
            message = f"no {' or '.join(missing)} worker is alive (starting workers report within seconds: retry)"
            raise APIError(503, message, code="no_workers", retry_after_s=retry_after_s)
        self._queue = self.bus.tracker.open(self.request_id)
        trace.hop(self.request_id, "gw.submit")
        try:
            reply = await self.bus.submit(self.request)
        except SubmitFailed as exc:
            self.is_finished = True  # refused: nobody holds anything to cancel
            self.bus.tracker.close(self.request_id)
            if exc.maybe_accepted:
                await self.bus.cancel([self.request_id], "submit_timeout")
            metrics.ERRORS.labels("gateway", exc.code).inc()
            raise downstream_error(exc.code, exc.message, exc.retry_after_s or retry_after_s) from None
        self._accepted_at = time.monotonic()
        self.bus.tracker.get(self.request_id).holder = reply.worker_id  # watched: see migration.py
        metrics.PROMPT_TOKENS.inc(len(self.request.prompt_token_ids))
        self.bus.traffic.on_accepted(self.request)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Token events in order until the finishing one; raises APIError on error or timeout."""
        assert self._queue is not None, "start() first"
        while not self.is_finished:
            event = await self._next_event()
            if isinstance(event, Lost) or (isinstance(event, ErrorEvent) and event.code == "worker_lost"):
                lost = event if isinstance(event, Lost) else Lost(self.request_id, "", event.message)
                try:
                    self.request = await migrate(self.bus, self.request, lost, self.max_attempts)
                except APIError:
                    self._cancel_reason = "error: worker_lost"
                    self._count_failure("worker_lost")
                    raise
                continue
            if isinstance(event, ErrorEvent):
                self._cancel_reason = f"error: {event.code}"
                self._count_failure(event.code)
                raise downstream_error(event.code, event.message, self._retry_after_s)
            self.is_finished = event.finish_reason is not None
            self._observe(event)
            yield event

    async def event_batches(self) -> AsyncIterator[list[TokenEvent]]:
        """events() in runs: each list holds an event and those already queued behind it, so a stream
        that fell a few steps behind goes out in one socket write instead of one per token. Events
        before an error still come out (as their own list) before it is raised."""
        queue = self._queue
        assert queue is not None, "start() first"
        batch: list[TokenEvent] = []
        try:
            async for event in self.events():
                batch.append(event)
                if self.is_finished or queue.empty():
                    yield batch
                    batch = []
        except APIError:
            if batch:
                yield batch
            raise

    async def _next_event(self) -> Event:
        """The next queued event; a Lost marker if the holder stops reporting; APIError 504 when
        nothing came for timeout_s."""
        queue = self._queue
        assert queue is not None, "start() first"
        self._waiting_since = time.monotonic()
        if not queue.empty():  # no timer for an event already here (most of them, under load)
            return queue.get_nowait()
        while True:
            left = self._waiting_since + self.timeout_s - time.monotonic()
            if left <= 0:
                self._cancel_reason = "timeout"
                self._count_failure("timeout")
                raise APIError(504, f"no output for {self.timeout_s:g}s; the request was cancelled", code="timeout")
            try:
                return await asyncio.wait_for(queue.get(), min(left, WATCH_INTERVAL_S))
            except asyncio.TimeoutError:
                lost = self._watch.check(time.monotonic(), self._waiting_since)
                if lost is not None:
                    return lost

    def _observe(self, event: TokenEvent) -> None:
        now = time.monotonic()
        if event.token_ids:
            gap = metrics.INTER_TOKEN_LATENCY if self._last_event_at else metrics.TIME_TO_FIRST_TOKEN
            gap.observe(now - (self._last_event_at or self._accepted_at))
            self._first_event_at = self._first_event_at or now
            self._last_event_at = now
            self._num_tokens += len(event.token_ids)
            metrics.GENERATION_TOKENS.inc(len(event.token_ids))
        if event.finish_reason is not None:
            metrics.REQUESTS_FINISHED.labels(event.finish_reason).inc()
            metrics.E2E_REQUEST_LATENCY.observe(now - self._accepted_at)
            self._count_slo()

    def _count_slo(self) -> None:
        if not self._first_event_at:
            return  # finished without a token: no latency to judge
        ttft = self._first_event_at - self._accepted_at
        tpot = (self._last_event_at - self._first_event_at) / (self._num_tokens - 1) if self._num_tokens > 1 else None
        self.bus.traffic.on_finished(ttft, tpot)

    def _count_failure(self, kind: str) -> None:
        metrics.REQUESTS_FINISHED.labels("error").inc()
        metrics.ERRORS.labels("gateway", kind).inc()

    async def close(self) -> None:
        """Idempotent: stop routing events here; cancel everywhere unless it finished."""
        self.bus.tracker.close(self.request_id)
        if not self.is_finished:
            self.is_finished = True
            if self._cancel_reason == "client_disconnected":
                metrics.REQUESTS_FINISHED.labels("abort").inc()
            await self.bus.cancel([self.request_id], self._cancel_reason)

"""Migration: a request whose worker died goes on elsewhere, and the client never notices.

The gateway knows who holds each request: the prefill worker named in `SubmitReply.worker_id`,
then whichever worker last sent its tokens (`OutputBatch.worker_id`). A holder whose load
reports stop for more than `MISSED_REPORTS` intervals is lost (a draining worker still reports,
so it is not). The request is then resubmitted as attempt + 1 with `output_token_ids` = every
token already queued for the client: the new prefill worker recomputes the KV of prompt + those
tokens and continues at index len(output_token_ids), so the stream has no gap and no repeat, and
a greedy request ends with exactly the text of a fault-free run. Stale copies of older attempts
are cancelled (`Cancel.below_attempt`) and anything they still send is dropped by the tracker.

Attempts are bounded (`FERRY_MAX_ATTEMPTS`, first try included); past that the client gets a 503
`worker_lost` naming how many tries failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from ferry import metrics
from ferry.protocol import GenerateRequest
from ferry_services.gateway.bus import GatewayBus, SubmitFailed
from ferry_services.gateway.errors import APIError
from ferry_services.gateway.tracker import Lost

if TYPE_CHECKING:
    from ferry_services.gateway.tracker import _Pending

log = logging.getLogger("ferry.gateway")

WATCH_INTERVAL_S = 0.5
"""How often a waiting request checks that its holder still reports."""
MAX_SETTLE_S = 2.0
"""Most time to wait, after a loss, for the balancers to notice it too (they use the same rule)."""
RETRY_SUBMIT_S = 0.5
"""Pause before resubmitting when no worker took the migrated request."""


RECONNECT_QUIET_S = 1.0
"""After the gateway's bus reconnects, a request that hears nothing for this long is resubmitted."""


class LossWatch:
    """Decides, on each quiet tick of one request, whether its current attempt is lost:
    - its holder stopped reporting (`holder_lost`), or
    - the gateway's NATS connection was re-established and the request has heard nothing since:
      events published while we were not subscribed are gone, the finishing one included, and no
      later event would reveal the gap (a NATS restart does exactly this)."""

    def __init__(self, bus: GatewayBus, request_id: str) -> None:
        self.bus = bus
        self.request_id = request_id
        self._reconnects = bus.num_reconnects
        self._noticed_at: float | None = None

    def check(self, now: float, waiting_since: float) -> Lost | None:
        lost = holder_lost(self.bus, self.request_id, now)
        if lost is not None:
            return lost
        if self.bus.num_reconnects != self._reconnects:
            self._reconnects = self.bus.num_reconnects
            self._noticed_at = now
        if self._noticed_at is None:
            return None
        if waiting_since > self._noticed_at:  # an event came after the reconnect: the stream is fine
            self._noticed_at = None
            return None
        if now - self._noticed_at > RECONNECT_QUIET_S:
            self._noticed_at = None
            return Lost(self.request_id, "", "nothing heard since the gateway's bus reconnected", "bus_reconnect")
        return None


def holder_lost(bus: GatewayBus, request_id: str, now: float) -> Lost | None:
    """A Lost marker when the worker holding `request_id` stopped reporting; else None."""
    pending = bus.tracker.get(request_id)
    if pending is None or not pending.holder:
        return None
    overdue = bus.workers.silent_for(pending.holder, now)
    if overdue is None or overdue <= 0:
        return None
    return Lost(request_id, pending.holder, "no load report for more than 3 intervals", "worker_silent")


def settle_delay_s(bus: GatewayBus, lost: Lost, now: float) -> float:
    """Wait until the balancers, which heard the lost worker's last report at about the same time,
    have taken it out of routing too: about one report interval past our own deadline."""
    overdue = bus.workers.silent_for(lost.worker_id, now)
    if overdue is None:
        return 0.0
    interval = bus.workers.interval_of(lost.worker_id) or 0.0
    return min(MAX_SETTLE_S, max(0.0, (1.0 - overdue) * interval))


async def migrate(bus: GatewayBus, request: GenerateRequest, lost: Lost, max_attempts: int) -> GenerateRequest:
    """Resubmit `request` after `lost`; returns the attempt now running, or raises the APIError the
    client gets when every attempt is used up or the request cannot be placed again."""
    pending = bus.tracker.get(request.request_id)
    if pending is None:  # closed meanwhile: nothing to do
        return request
    await asyncio.sleep(settle_delay_s(bus, lost, time.monotonic()))
    problems = [f"worker {lost.worker_id} lost ({lost.reason})"]  # the last one names the latest try's

    def refused(state: RetryCallState) -> None:
        problems.append(f"resubmit refused ({_refusal(state).code})")

    retrying = AsyncRetrying(
        retry=retry_if_exception(lambda exc: isinstance(exc, SubmitFailed) and exc.code != "bad_request"),
        wait=lambda state: max(RETRY_SUBMIT_S, _refusal(state).retry_after_s),
        before_sleep=refused,
        reraise=True,  # the attempt bound is checked in each try: it counts the request's earlier attempts
    )
    try:
        async for attempt in retrying:
            with attempt:
                request = await _next_attempt(bus, request, pending, max_attempts, problems[-1])
                pending.holder = (await bus.submit(request)).worker_id
    except SubmitFailed as exc:  # bad_request: the request itself is refused, another try cannot help
        raise APIError(503, f"could not resubmit after {problems[-1]}: {exc.message}", code="worker_lost") from None
    metrics.MIGRATIONS.labels(lost.cause).inc()  # a migration is recovery, not an error
    return request


def _refusal(state: RetryCallState) -> SubmitFailed:
    """The SubmitFailed that ended the try (the only exception `retry` lets through to a retry)."""
    exc = state.outcome.exception() if state.outcome is not None else None
    assert isinstance(exc, SubmitFailed), exc
    return exc


async def _next_attempt(
    bus: GatewayBus, request: GenerateRequest, pending: _Pending, max_attempts: int, last_problem: str
) -> GenerateRequest:
    """The request as its next attempt (APIError past the bound), with older attempts cancelled."""
    attempt = max(request.attempt + 1, pending.attempt)
    if attempt >= max_attempts:
        metrics.ERRORS.labels("gateway", "worker_lost").inc()
        raise APIError(
            503,
            f"the request failed on {attempt} attempt(s), the last because {last_problem}; retry it",
            code="worker_lost",
        )
    request = dataclasses.replace(request, output_token_ids=list(pending.token_ids), attempt=attempt)
    pending.attempt = attempt  # from now on, older attempts' events are stale
    pending.holder = ""
    await bus.cancel([request.request_id], f"migrated: {last_problem}", below_attempt=attempt)
    log.warning(
        "migrating %s to attempt %d after %d tokens: %s",
        request.request_id,
        attempt,
        len(pending.token_ids),
        last_problem,
    )
    return request

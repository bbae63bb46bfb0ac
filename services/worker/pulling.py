"""How a worker takes work: a pull loop over its durable JetStream consumer that fetches as many
queued messages as there is room for (variable-size batches) and hands them to `Worker.accept`.
Part of `Worker` (base.py). The consumer is opened before the model loads (`open_work_consumer`)
and recreated if it disappears (JetStream restarted, or a balancer took this worker for dead).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from ferry.bus import WorkConsumer, WorkItem, ensure_work_consumer, raise_if_cancelled
from ferry_services.worker.ledger import RequestLedger
from ferry_services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

MAX_FETCH = 32
"""Most messages one pull asks for."""
FETCH_WAIT_S = 1.0
"""A pull waits this long for the first message (long poll: an idle worker does not spin)."""


class Pulling:
    """Mixed into `Worker`, which provides these:"""

    role: str
    worker_id: str
    work_type: type
    settings: WorkerSettings
    js: JetStreamContext
    consumer: WorkConsumer | None
    ledger: RequestLedger
    engine: Any
    has_room: asyncio.Event
    accept: Callable[[list[WorkItem]], Awaitable[None]]

    async def pull_loop(self) -> None:
        assert self.consumer is not None, "start() first"
        while not self.ledger.draining:
            raise_if_cancelled()
            budget = self.pull_budget()
            if budget <= 0:
                self.has_room.clear()
                await _wait(self.has_room, FETCH_WAIT_S)
                continue
            try:
                items: list[WorkItem[Any]] = await self.consumer.fetch(
                    min(budget, MAX_FETCH), self.work_type, timeout_s=FETCH_WAIT_S
                )
            except ServiceUnavailableError:  # our consumer is gone: JetStream restarted, or a balancer took us for dead
                await self.restore_consumer()
                continue
            await self.accept(items)

    async def restore_consumer(self) -> None:
        """Recreate this worker's durable consumer (idempotent); the bound pull subscription then
        works again, as it pulls by the consumer's name."""
        log.warning("work consumer of %s unavailable; recreating it", self.worker_id)
        try:
            await ensure_work_consumer(self.js, self.role, self.worker_id, ack_wait_s=self.settings.ack_wait_s)
        except Exception as exc:  # JetStream not back yet: try again after a pause
            log.warning("could not recreate the work consumer: %r", exc)
            await asyncio.sleep(FETCH_WAIT_S)

    def pull_budget(self) -> int:
        """How many more messages to pull now, under the engine's cap in force (the SLO controller's,
        or the fixed one): what the cap leaves out stays in JetStream for other workers; the role
        refines it."""
        return self.engine.max_num_seqs - len(self.ledger)


async def open_work_consumer(js: JetStreamContext, settings: WorkerSettings) -> WorkConsumer:
    """This worker's durable consumer (created if missing). Opened before the model loads, so an
    autoscaler watching the consumer never sees a replica without one."""
    return await ensure_work_consumer(js, settings.work_role, settings.worker_id, ack_wait_s=settings.ack_wait_s)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass

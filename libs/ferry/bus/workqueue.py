"""JetStream work queues: stream FERRY_WORK and one durable pull consumer per worker.

Balancers publish a worker's work to `ferry.work.<role>.<worker>`; the stream keeps it (work-queue
retention: a message is deleted once acked) until that worker pulls it. Pulling, not pushing, is
what lets a worker take a *variable-size batch*: as many requests as its token budget allows right
now. A message not acked within `ack_wait_s` is redelivered, at most `max_deliver` times, so work
held by a worker that died comes back (the gateway's migration handles the request itself).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError

from ferry.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, encode, subjects

log = logging.getLogger("ferry.bus")

M = TypeVar("M")

WORK_MAX_AGE_S = 3600.0
"""Work nobody pulled within an hour is dropped: its client gave up long ago."""
STREAM_EXISTS_ERR_CODE = 10058  # "stream name already in use with a different configuration"
COMPARED_FIELDS = ("subjects", "retention", "storage", "discard", "max_age", "max_msg_size", "num_replicas")
"""What ferry sets on FERRY_WORK; the server fills in the rest, which is never compared."""


def work_stream_config(storage: StorageType = StorageType.FILE, replicas: int = 1) -> StreamConfig:
    if not 1 <= replicas <= 5:
        raise ValueError(f"replicas={replicas!r} must be in 1..5 (JetStream's limit)")
    return StreamConfig(
        name=subjects.WORK_STREAM,
        subjects=[subjects.WORK_ALL],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=storage,
        discard=DiscardPolicy.OLD,
        max_age=WORK_MAX_AGE_S,
        max_msg_size=MAX_MESSAGE_BYTES,
        num_replicas=replicas,
        description="ferry: queued prefill/decode work, one subject per worker",
    )


async def ensure_work_stream(js: JetStreamContext, storage: StorageType = StorageType.FILE, replicas: int = 1) -> None:
    """Create FERRY_WORK with `replicas` (FERRY_WORK_REPLICAS), or bring an existing one to this configuration.

    Safe to call from every process at every start: an existing stream that already matches is left
    alone (no update), one that differs is updated with a warning naming each change, and one with
    more replicas than asked keeps them: a service started without FERRY_WORK_REPLICAS never shrinks
    a replicated queue."""
    wanted = work_stream_config(storage, replicas)
    try:
        existing = (await js.stream_info(subjects.WORK_STREAM)).config
    except NotFoundError:
        if await _create(js, wanted):
            return
        existing = (await js.stream_info(subjects.WORK_STREAM)).config  # another process was first
    await _reconcile(js, existing, wanted)


async def _create(js: JetStreamContext, config: StreamConfig) -> bool:
    """True if created here; False if another process created it meanwhile."""
    try:
        await js.add_stream(config)
    except APIError as exc:
        if isinstance(exc, BadRequestError) and exc.err_code == STREAM_EXISTS_ERR_CODE:
            return False
        raise _stream_error(exc, config) from None
    log.info("created stream %s with %d replica(s)", config.name, config.num_replicas)
    return True


async def _reconcile(js: JetStreamContext, existing: StreamConfig, wanted: StreamConfig) -> None:
    if (existing.num_replicas or 1) > (wanted.num_replicas or 1):
        log.info(
            "stream %s keeps its %d replicas (this service asks %d: FERRY_WORK_REPLICAS); never reduced here",
            wanted.name,
            existing.num_replicas,
            wanted.num_replicas,
        )
        wanted = dataclasses.replace(wanted, num_replicas=existing.num_replicas)
    changes = stream_config_changes(existing, wanted)
    if not changes:
        return
    log.warning("updating stream %s: %s", wanted.name, "; ".join(changes))
    try:
        await js.update_stream(wanted)
    except APIError as exc:
        raise _stream_error(exc, wanted) from None


def stream_config_changes(existing: StreamConfig, wanted: StreamConfig) -> list[str]:
    """`field: old -> new` for every field ferry sets that differs."""
    changes = []
    for name in COMPARED_FIELDS:
        old, new = getattr(existing, name), getattr(wanted, name)
        if name == "num_replicas":
            old = old or 1  # the server may leave it unset for R1
        if old != new:
            changes.append(f"{name}: {old!r} -> {new!r}")
    return changes


def _stream_error(exc: APIError, config: StreamConfig) -> RuntimeError:
    return RuntimeError(
        f"JetStream refused stream {config.name} with {config.num_replicas} replica(s) "
        f"(FERRY_WORK_REPLICAS; a NATS cluster of at least that many JetStream nodes is needed): {exc.description}"
    )


async def publish_work(js: JetStreamContext, role: str, worker_id: str, msg: Any, timeout_s: float = 5.0) -> int:
    """Queue `msg` for one worker; returns its stream sequence once JetStream has stored it."""
    ack = await js.publish(subjects.work(role, worker_id), encode(msg), timeout=timeout_s, stream=subjects.WORK_STREAM)
    return ack.seq


@dataclass(slots=True)
class WorkItem(Generic[M]):
    """One pulled message: settle it with exactly one of ack / nak / term (in_progress extends the lease)."""

    msg: M
    raw: Msg
    num_delivered: int
    """1 on the first delivery; more means an earlier holder did not ack in time."""
    num_pending: int = 0
    """Messages queued for this consumer behind this one when it was delivered (JetStream's count)."""

    async def ack(self) -> None:
        await self.raw.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        """Give it back for redelivery (after `delay_s`), e.g. when this worker is draining."""
        await self.raw.nak(delay=delay_s)

    async def in_progress(self) -> None:
        """Still working on it: restart the ack_wait timer."""
        await self.raw.in_progress()

    async def term(self) -> None:
        """Never redeliver it."""
        await self.raw.term()


class WorkConsumer:
    """A worker's bound pull subscription on its durable consumer."""

    def __init__(self, psub: JetStreamContext.PullSubscription, name: str, js: JetStreamContext) -> None:
        self._psub = psub
        self._js = js
        self.name = name
        self.num_bad = 0
        """Messages that did not decode; terminated, never returned."""

    async def fetch(self, max_msgs: int, msg_type: type[M], timeout_s: float = 0.05) -> list[WorkItem[M]]:
        """Up to `max_msgs` of what is queued now; waits at most `timeout_s` for the first, else []."""
        if max_msgs < 1:
            raise ValueError(f"max_msgs={max_msgs!r} must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        try:
            raws = await self._psub.fetch(batch=max_msgs, timeout=timeout_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []
        items = []
        for raw in raws:
            item = await self._decode(raw, msg_type)
            if item is not None:
                items.append(item)
        return items

    async def _decode(self, raw: Msg, msg_type: type[M]) -> WorkItem[M] | None:
        try:
            msg = decode(raw.data, msg_type)
        except ProtocolError as exc:
            self.num_bad += 1
            log.warning("%s: dropping bad work message on %s: %s", self.name, raw.subject, exc)
            await raw.term()
            return None
        meta = raw.metadata
        return WorkItem(msg=msg, raw=raw, num_delivered=meta.num_delivered, num_pending=meta.num_pending)

    async def num_pending(self, timeout_s: float = 0.5) -> int:
        """Messages queued for this consumer and not delivered yet (JetStream's count; one API request)."""
        info = await self._js.consumer_info(subjects.WORK_STREAM, self.name, timeout=timeout_s)
        return info.num_pending

    async def close(self) -> None:
        """Stop pulling; the durable consumer and its queued work stay on the server."""
        await self._psub.unsubscribe()


async def ensure_work_consumer(
    js: JetStreamContext, role: str, worker_id: str, ack_wait_s: float = 30.0, max_deliver: int = 5
) -> WorkConsumer:
    """Create (or update) the worker's durable pull consumer and bind to it."""
    if ack_wait_s <= 0:
        raise ValueError(f"ack_wait_s={ack_wait_s!r} must be > 0")
    if max_deliver < 1:
        raise ValueError(f"max_deliver={max_deliver!r} must be >= 1")
    name = subjects.work_consumer(role, worker_id)
    config = ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=subjects.work(role, worker_id),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        # Balancers never delete a worker's consumer (it may still live); JetStream drops one that nobody
        # pulled from or acked on for as long as work may wait in the stream.
        inactive_threshold=WORK_MAX_AGE_S,
        max_deliver=max_deliver,
        description=f"ferry {role} worker {worker_id}",
    )
    await js.add_consumer(subjects.WORK_STREAM, config)  # with a name: create, or update if it exists
    psub = await js.pull_subscribe_bind(durable=name, stream=subjects.WORK_STREAM)
    return WorkConsumer(psub, name, js)


async def delete_work_consumer(js: JetStreamContext, role: str, worker_id: str) -> bool:
    """Remove a worker's durable consumer; False if it did not exist. Its queued messages stay in the stream."""
    try:
        return await js.delete_consumer(subjects.WORK_STREAM, subjects.work_consumer(role, worker_id))
    except NotFoundError:
        return False

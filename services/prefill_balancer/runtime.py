"""What both balancers share: the live worker view fed by load reports, publishing work into
JetStream, and re-routing the queued work of workers that fell silent.

Reads `ferry.load.<role>.*`; writes `ferry.work.<role>.<worker>` (stream FERRY_WORK); pulls from a
silent worker's durable consumer `<role>-<worker>` to move its queued messages to live workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from ferry import metrics
from ferry.bus import publish_work, raise_if_cancelled
from ferry.protocol import LoadReport, ProtocolError, decode, subjects
from ferry_services.prefill_balancer.view import WorkerView

log = logging.getLogger(__name__)

Rerouter = Callable[[bytes], Awaitable[bool]]
"""Moves one queued message to a live worker; False when none can take it now."""

REROUTE_BATCH = 32
STOP_TIMEOUT_S = 5.0


class BalancerRuntime:
    """The I/O around a `WorkerView`; the service decides, this moves bytes."""

    def __init__(self, nc: Client, role: str, *, silent_after_intervals: float, tick_s: float) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.role = role
        self.view = WorkerView(role, silent_after_intervals=silent_after_intervals)
        self.tick_s = tick_s
        self.num_rerouted = 0
        self._draining: set[str] = set()
        """Silent workers whose consumer may still hold messages (redeliveries after ack_wait)."""
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    async def start(self, rerouter: Rerouter) -> None:
        await self.nc.subscribe(subjects.load_role(self.role), cb=self._on_load)
        await self.nc.flush()  # the server has the subscription: no report published after start() is missed
        self._tasks.append(asyncio.create_task(self._tick_forever(rerouter)))

    async def stop(self) -> None:
        # The flag, not only cancel(): nats-py can turn a cancelled fetch into a TimeoutError, which
        # the tick loop would log and survive, leaving gather() waiting forever.
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT_S)
        if pending:
            log.warning(
                "%s balancer: %d background task(s) did not stop within %.0f s", self.role, len(pending), STOP_TIMEOUT_S
            )

    async def publish_work(self, worker_id: str, msg: object) -> None:
        """Append to the worker's queue; returns once JetStream has stored it."""
        await publish_work(self.js, self.role, worker_id, msg)

    async def _on_load(self, msg) -> None:
        try:
            report = decode(msg.data, LoadReport)
            self.view.update(report, time.monotonic())
        except (ProtocolError, ValueError) as exc:
            log.warning("bad load report on %s: %s", msg.subject, exc)

    async def _tick_forever(self, rerouter: Rerouter) -> None:
        while not self._stopping:
            raise_if_cancelled()
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick(rerouter)
            except Exception:  # a failed tick must not stop the next one
                log.exception("balancer tick failed")

    async def tick(self, rerouter: Rerouter) -> None:
        for worker_id in self.view.expire(time.monotonic()):
            log.warning("%s worker %s fell silent: out of routing, re-routing its queue", self.role, worker_id)
            self._draining.add(worker_id)
            metrics.WORKER_QUEUE_DEPTH.remove(self.role, worker_id)
        await self.sample_queue_depths()
        for worker_id in sorted(self._draining):
            if worker_id not in self.view.silent_ids:  # it came back: its queue is its own again
                self._draining.discard(worker_id)
            elif await self.drain(worker_id, rerouter):
                self._draining.discard(worker_id)

    async def sample_queue_depths(self) -> None:
        """Messages waiting on each live worker's consumer, for the ferry_worker_queue_depth gauge."""
        for worker_id in list(self.view.workers):
            try:
                info = await self.js.consumer_info(subjects.WORK_STREAM, subjects.work_consumer(self.role, worker_id))
            except NotFoundError:
                continue
            metrics.WORKER_QUEUE_DEPTH.labels(self.role, worker_id).set(info.num_pending)

    async def drain(self, worker_id: str, rerouter: Rerouter) -> bool:
        """Move the silent worker's queued messages; True once its consumer is empty and gone."""
        durable = subjects.work_consumer(self.role, worker_id)
        try:
            sub = await self.js.pull_subscribe_bind(durable=durable, stream=subjects.WORK_STREAM)
        except NotFoundError:
            return True
        try:
            while await self._move_batch(sub, rerouter):
                pass
        finally:
            await sub.unsubscribe()
        return await self._delete_if_empty(durable)

    async def _move_batch(self, sub, rerouter: Rerouter) -> bool:
        try:
            msgs = await sub.fetch(REROUTE_BATCH, timeout=0.2)
        except (NatsTimeout, asyncio.TimeoutError):
            return False
        for msg in msgs:
            if not await rerouter(msg.data):
                await msg.nak(delay=1.0)  # nobody can take it now; try again on a later tick
                return False
            await msg.ack_sync()  # confirmed, so the emptiness check below sees it
            self.num_rerouted += 1
        return True

    async def _delete_if_empty(self, durable: str) -> bool:
        try:
            info = await self.js.consumer_info(subjects.WORK_STREAM, durable)
        except NotFoundError:
            return True
        if info.num_pending or info.num_ack_pending:
            return False  # delivered-but-unacked messages come back after ack_wait
        await self.js.delete_consumer(subjects.WORK_STREAM, durable)
        return True

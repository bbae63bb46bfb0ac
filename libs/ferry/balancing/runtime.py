"""What both balancers do around their policy: follow the workers' load reports, publish work into
JetStream, and move the queued work of workers that fell silent.

Reads `ferry.load.<role>.*` (the `load` subscription of the balancer's micro service); writes
`ferry.work.<role>.<worker>` (stream FERRY_WORK); pulls from a silent worker's durable consumer
`<role>-<worker>` to re-route its queued messages (the `reroute` input: each message moved, or
dropped as unreadable, is counted there, so `nats micro stats <role>-balancer` shows it).

A silent worker's consumer is emptied but never deleted. The worker may still exist (a stalled
process, a partition, a restart under the same id) and pulls from it again when it comes back; and
KEDA's JetStream scaler reads one named consumer and, when that consumer is missing, falls back to
the stream's last sequence, which scales workers to the maximum. JetStream itself removes a consumer
that nobody pulls from or acks on for its inactive_threshold (set in ferry.bus.workqueue).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from ferry import metrics
from ferry.balancing.view import WorkerView
from ferry.bus import BusError, Service, publish_work, raise_if_cancelled
from ferry.protocol import LoadReport, ProtocolError, decode, subjects

log = logging.getLogger("ferry.balancing")

W = TypeVar("W")
Rerouter = Callable[[W], Awaitable[bool]]
"""Moves one queued message to a live worker; False when none can take it now."""

REROUTE_BATCH = 32
STOP_TIMEOUT_S = 5.0


class BalancerRuntime(Generic[W]):
    """The I/O around a `WorkerView`; the balancer's policy decides, this moves bytes."""

    def __init__(
        self,
        nc: Client,
        service: Service,
        role: str,
        work_type: type[W],
        reroute: Rerouter[W],
        *,
        silent_after_intervals: float,
        tick_s: float,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.role = role
        self.view = WorkerView(role, silent_after_intervals=silent_after_intervals)
        self.tick_s = tick_s
        self.work_type = work_type
        self.reroute = reroute
        self.draining: set[str] = set()
        """Silent workers whose consumer may still hold messages (redeliveries after ack_wait)."""
        service.subscribe(subjects.load_role(role), LoadReport, self.on_load, name="load")
        self.rerouted = service.input("reroute", subjects.work_role(role))
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def num_rerouted(self) -> int:
        """Messages moved from silent workers' queues to live workers."""
        return self.rerouted.num_requests - self.rerouted.num_errors

    async def start(self) -> None:
        """Run the silent-worker loop in a task of its own (`stop` ends it); `run_service` runs `run()` instead."""
        self._tasks.append(asyncio.create_task(self.run()))

    async def stop(self) -> None:
        # The flag, not only cancel(): nats-py can turn a cancelled fetch into a TimeoutError, which
        # the tick loop would log and survive, leaving the wait below to time out.
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

    async def on_load(self, report: LoadReport) -> None:
        try:
            self.view.update(report, time.monotonic())
        except ValueError as exc:  # a report of another role on this role's subject
            raise BusError("bad_request", str(exc)) from None

    async def run(self) -> None:
        """Every `tick_s`: find workers that fell silent, sample queue depths, move silent workers' queues."""
        while not self._stopping:
            raise_if_cancelled()
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except Exception:  # a failed tick must not stop the next one
                log.exception("balancer tick failed")

    async def tick(self) -> None:
        for worker_id in self.view.expire(time.monotonic()):
            log.warning("%s worker %s fell silent: out of routing, re-routing its queue", self.role, worker_id)
            self.draining.add(worker_id)
            metrics.WORKER_QUEUE_DEPTH.remove(self.role, worker_id)
        await self.sample_queue_depths()
        for worker_id in sorted(self.draining):
            if worker_id not in self.view.silent_ids:  # it came back: its queue is its own again
                self.draining.discard(worker_id)
            elif await self.drain(worker_id):
                self.draining.discard(worker_id)

    async def sample_queue_depths(self) -> None:
        """Messages waiting on each live worker's consumer, for the ferry_worker_queue_depth gauge."""
        for worker_id in list(self.view.workers):
            try:
                info = await self.js.consumer_info(subjects.WORK_STREAM, subjects.work_consumer(self.role, worker_id))
            except NotFoundError:
                continue
            metrics.WORKER_QUEUE_DEPTH.labels(self.role, worker_id).set(info.num_pending)

    async def drain(self, worker_id: str) -> bool:
        """Move the silent worker's queued messages; True once its consumer is empty (or gone).
        The consumer stays (see the module docstring)."""
        durable = subjects.work_consumer(self.role, worker_id)
        try:
            sub = await self.js.pull_subscribe_bind(durable=durable, stream=subjects.WORK_STREAM)
        except NotFoundError:
            return True
        try:
            while await self._move_batch(sub):
                pass
        finally:
            await sub.unsubscribe()
        return await self._is_empty(durable)

    async def _move_batch(self, sub) -> bool:
        try:
            msgs = await sub.fetch(REROUTE_BATCH, timeout=0.2)
        except (NatsTimeout, asyncio.TimeoutError):
            return False
        for msg in msgs:
            if not await self._move(msg):
                await msg.nak(delay=1.0)  # nobody can take it now; try again on a later tick
                return False
            await msg.ack_sync()  # confirmed, so the emptiness check sees it
        return True

    async def _move(self, msg: Msg) -> bool:
        """Re-route one message; an unreadable one is dropped (True), counted as an error."""
        start_ns = time.perf_counter_ns()
        try:
            work = decode(msg.data, self.work_type)
        except ProtocolError as exc:
            log.error("dropping an unreadable message from a silent worker's queue (%s): %s", msg.subject, exc)
            self.rerouted.record(time.perf_counter_ns() - start_ns, error=f"bad_request: {exc}")
            return True
        if not await self.reroute(work):
            return False
        self.rerouted.record(time.perf_counter_ns() - start_ns)
        return True

    async def _is_empty(self, durable: str) -> bool:
        try:
            info = await self.js.consumer_info(subjects.WORK_STREAM, durable)
        except NotFoundError:
            return True
        return not info.num_pending and not info.num_ack_pending  # unacked ones come back after ack_wait

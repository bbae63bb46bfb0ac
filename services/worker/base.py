"""What prefill and decode workers share: the engine loop, pulling work, token events, cancels,
load reports. The role subclasses decide what a pulled message becomes and what a step's
outputs lead to (prefill: hand-off; decode: nothing more).

Three loops run on the asyncio thread while the engine computes on its own thread
(`ComputeThread`): the engine loop (step, publish, repeat while there is work; the decode worker
queues the next step before publishing), the pull loop (fetch as many queued messages as there is
room for: variable-size batches) and the report loop.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from typing import Any

from nats.aio.client import Client
from nats.js.errors import ServiceUnavailableError

from ferry import metrics
from ferry.bus import Service, WorkConsumer, WorkItem, ensure_work_consumer, raise_if_cancelled, trace
from ferry.protocol import Cancel, ErrorEvent, GenerateRequest, LoadReport, OutputBatch, encode, subjects
from ferry_services.worker.compute import ComputeThread
from ferry_services.worker.events import batch_by_gateway
from ferry_services.worker.recent import RecentIds
from ferry_services.worker.settings import WorkerSettings
from ferry_services.worker.stats import WorkStats

log = logging.getLogger(__name__)

MAX_FETCH = 32
"""Most messages one pull asks for."""
FETCH_WAIT_S = 1.0
"""A pull waits this long for the first message (long poll: an idle worker does not spin)."""
BACKLOG_TIMEOUT_S = 0.25
"""A report waits at most this long for JetStream's count of the worker's queued messages."""
SHUTDOWN_GRACE_S = 20.0
"""On SIGTERM, requests already in this worker get this long to finish."""


class Worker(abc.ABC):
    role = ""
    work_type: type = object
    pipelined = False
    """Queue step N+1 before handling step N's outputs. Only where `after_step` needs nothing from
    the engine before the next step: the prefill worker takes its finished prefills off the engine
    right after a step, and a step queued first would delay every hand-off by one step."""

    def __init__(self, nc: Client, settings: WorkerSettings, engine: Any, store: Any) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.worker_id = settings.worker_id
        self.engine = engine
        self.store = store
        self.namespace = store.namespace
        self.compute = ComputeThread(engine)
        self.requests: dict[str, GenerateRequest] = {}
        """Every request this worker holds: queued in the engine, running, or in transfer."""
        self.held: dict[str, WorkItem] = {}
        """Pulled JetStream messages not settled yet, by request id."""
        self.cancelled = RecentIds()
        self.has_work = asyncio.Event()
        self.has_room = asyncio.Event()
        self.num_adding = 0
        """Engine additions queued on the engine thread and not finished: work for the engine loop."""
        self.draining = False
        self.consumer: WorkConsumer | None = None
        self.tasks: set[asyncio.Task] = set()
        self._num_cached_reported = 0
        self.num_backlog = 0
        """Messages queued for this worker in JetStream, as of the last report."""
        self.service = Service(
            f"{self.role}-worker",
            description=f"ferry {self.role} worker",
            metadata={"worker_id": self.worker_id, "model": settings.model_name},
        )
        self.service.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        self.work_stats = WorkStats(self)  # pulled work, steps, tokens, backlog in `nats micro stats`

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        consumer = await ensure_work_consumer(self.js, self.role, self.worker_id, ack_wait_s=self.settings.ack_wait_s)
        self.consumer = self.work_stats.count(consumer)

    def background(self) -> list:
        return [self.engine_loop(), self.pull_loop(), self.report_loop()]

    async def shutdown(self) -> None:
        """Stop pulling, tell the balancers, let what is here finish (bounded), give back the rest."""
        self.draining = True
        await self.publish_report()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.requests and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        for request_id in list(self.held):
            await self.settle(request_id, redeliver=True)
        if self.consumer is not None:
            await self.consumer.close()
        self.compute.close()

    # ---- the engine loop ---------------------------------------------------------------------
    async def engine_loop(self) -> None:
        queued = None  # the step already queued on the engine thread (pipelined roles)
        while True:
            raise_if_cancelled()
            if queued is None:
                if not self.num_adding and not self.engine.has_unfinished_requests():
                    self.has_work.clear()
                    await self.has_work.wait()
                    continue
                queued = self.compute.submit(self.step)
            start = time.perf_counter()
            outputs = await queued
            queued = None
            log.debug("step: %d outputs, waited %.1f ms for them", len(outputs), (time.perf_counter() - start) * 1000)
            if outputs and self.pipelined and self.engine.has_unfinished_requests():
                # the next step computes while this one's tokens are published: the engine thread
                # never waits for this loop (thread hops, encoding, other tasks) between two steps
                queued = self.compute.submit(self.step)
            if outputs:  # sequences that produced a token this step (chunked prefills excluded)
                metrics.BATCH_SIZE.labels(self.role).observe(len(outputs))
            await self.after_step(outputs)
            self.has_room.set()
            if not outputs:  # e.g. everything waits for blocks: do not spin on the engine thread
                await asyncio.sleep(0.001)

    async def add_to_engine(self, fn, *args) -> Any:
        """Run an engine addition (`add_request`, ...) with the next step queued right behind it on
        the engine thread, instead of after a trip back to this loop: one thread hop less before a
        new request's first token. Raises what `fn` raises."""
        self.num_adding += 1
        added = self.compute.submit(fn, *args)
        self.has_work.set()
        try:
            return await added
        finally:
            self.num_adding -= 1

    def step(self) -> Any:
        """Runs on the engine thread."""
        trace.hop("*", f"{self.role[0]}w.step_start")
        outputs = self.engine.step()
        trace.hop("*", f"{self.role[0]}w.step_end")
        return outputs

    async def after_step(self, outputs: Any) -> None:
        await self.publish_outputs(outputs)
        for out in outputs:
            if out.finish_reason is not None:
                self.forget(out.request_id)

    async def publish_outputs(self, outputs: list) -> None:
        gateway_of = {rid: r.gateway_id for rid, r in self.requests.items()}
        for gateway_id, batch in batch_by_gateway(outputs, gateway_of, self.worker_id).items():
            for event in batch.tokens:  # the gateway drops events of attempts it migrated away from
                event.attempt = self.requests[event.request_id].attempt
            await self.nc.publish(subjects.out(gateway_id), encode(batch))

    async def publish_error(self, request: GenerateRequest, code: str, message: str, retryable: bool) -> None:
        error = ErrorEvent(request.request_id, code, message, retryable, attempt=request.attempt)
        await self.nc.publish(subjects.out(request.gateway_id), encode(OutputBatch(self.worker_id, errors=[error])))

    # ---- pulling -----------------------------------------------------------------------------
    async def pull_loop(self) -> None:
        assert self.consumer is not None, "start() first"
        while not self.draining:
            raise_if_cancelled()
            budget = self.pull_budget()
            if budget <= 0:
                self.has_room.clear()
                await _wait(self.has_room, FETCH_WAIT_S)
                continue
            try:
                items = await self.consumer.fetch(min(budget, MAX_FETCH), self.work_type, timeout_s=FETCH_WAIT_S)
            except ServiceUnavailableError:  # our consumer is gone: JetStream restarted, or a balancer took us for dead
                await self.restore_consumer()
                continue
            for item in items:
                if self.draining:
                    await item.nak()
                else:
                    await self.accept(item)

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
        """How many more messages to pull now; the role refines it."""
        return self.settings.max_running - len(self.requests)

    @abc.abstractmethod
    async def accept(self, item: WorkItem) -> None:
        """Take one pulled message: hold it and start its work."""

    def is_new(self, request_id: str, attempt: int = 0) -> bool:
        """False for a cancelled request or a redelivery of one already here."""
        held = self.requests.get(request_id)
        return request_id not in self.cancelled and (held is None or attempt > held.attempt)

    def is_current(self, request: GenerateRequest) -> bool:
        """Still held here as this very attempt: not cancelled or replaced meanwhile."""
        return self.requests.get(request.request_id) is request

    async def abort_if_gone(self, request: GenerateRequest) -> bool:
        """After adding `request` to the engine: True (and the engine's copy aborted) when a cancel or
        a newer attempt came in while the addition waited for the engine thread. That cancel's own
        abort may have run first and found nothing; without this the engine would keep a sequence
        this worker no longer tracks: its blocks never freed, and a newer attempt refused as
        'already in the engine'."""
        if self.is_current(request):
            return False
        await self.compute.call(self.engine.abort_request, request.request_id)
        return True

    def is_stale(self, request_id: str, attempt: int) -> bool:
        """An older attempt than the one held here: a migrated request's leftover copy."""
        held = self.requests.get(request_id)
        return held is not None and attempt < held.attempt

    async def drop_older_attempt(self, request_id: str) -> None:
        """A newer attempt of a request arrived (the gateway migrated it): the copy here goes."""
        if request_id in self.requests:
            await self.compute.call(self.engine.abort_request, request_id)
            self.forget(request_id)
            await self.settle(request_id)

    def hold(self, request: GenerateRequest, item: WorkItem) -> None:
        self.requests[request.request_id] = request
        self.held[request.request_id] = item

    async def settle(self, request_id: str, redeliver: bool = False) -> None:
        """Ack (done, or handed on) or nak (give it back) the request's message, once."""
        item = self.held.pop(request_id, None)
        if item is None:
            return
        try:
            await (item.nak() if redeliver else item.ack())
        except Exception:  # connection closing: JetStream redelivers after ack_wait, which is safe
            log.warning("could not settle the message of %s", request_id, exc_info=True)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("worker task failed", exc_info=task.exception())

    # ---- cancel ------------------------------------------------------------------------------
    async def on_cancel(self, cancel: Cancel) -> None:
        for request_id in cancel.request_ids:
            if cancel.below_attempt is None:
                self.cancelled.add(request_id)
            elif request_id not in self.requests or self.requests[request_id].attempt >= cancel.below_attempt:
                continue  # only stale copies of a migrated request go; its current attempt may be here
            if request_id in self.requests:
                await self.compute.call(self.engine.abort_request, request_id)
                self.forget(request_id)
                await self.settle(request_id)
                log.info("cancelled %s (%s)", request_id, cancel.reason)
        self.has_room.set()

    # ---- load reports ------------------------------------------------------------------------
    async def report_loop(self) -> None:
        last_lease = time.monotonic()
        while True:
            raise_if_cancelled()  # its JetStream requests go through asyncio.wait_for
            await self.refresh_backlog()
            await self.publish_report()
            if time.monotonic() - last_lease > self.settings.ack_wait_s / 3:
                last_lease = time.monotonic()
                await self.extend_leases()
            await asyncio.sleep(self.settings.load_interval_s)

    async def extend_leases(self) -> None:
        """Work held longer than ack_wait (long queues, hand-off retries) must not be redelivered."""
        for item in list(self.held.values()):
            try:
                await item.in_progress()
            except Exception:
                log.debug("in_progress failed", exc_info=True)

    def load_report(self) -> LoadReport:
        stats = self.compute.stats
        in_engine = stats.num_running + stats.num_waiting
        return LoadReport(
            worker_id=self.worker_id,
            role=self.role,
            model=self.settings.model_name,
            kv_namespace=self.namespace,
            timestamp=time.time(),
            interval_s=self.settings.load_interval_s,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting + max(0, len(self.requests) - in_engine),
            num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            max_running=self.settings.max_running,
            block_size=self.settings.block_size,
            draining=self.draining,
            num_backlog=self.num_backlog,
        )

    async def refresh_backlog(self) -> None:
        """Ask JetStream how much work waits for this worker; keep the last count if it cannot say."""
        if self.consumer is None:
            return
        try:
            self.num_backlog = await self.consumer.num_pending(timeout_s=BACKLOG_TIMEOUT_S)
        except Exception as exc:  # JetStream restarting or slow: a report must still go out
            log.debug("backlog of %s unknown: %r", self.worker_id, exc)

    async def publish_report(self) -> None:
        report = self.load_report()
        await self.nc.publish(subjects.load(self.role, self.worker_id), encode(report))
        self.update_metrics(report)

    def update_metrics(self, report: LoadReport) -> None:
        metrics.REQUESTS_RUNNING.labels(self.role).set(report.num_running)
        metrics.REQUESTS_WAITING.labels(self.role).set(report.num_waiting)
        metrics.KV_CACHE_USAGE.labels(self.role).set(report.kv_usage)
        num_cached = self.compute.stats.num_cached_tokens
        metrics.PREFIX_CACHE_HITS.labels(self.role).inc(max(0, num_cached - self._num_cached_reported))
        self._num_cached_reported = num_cached


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass

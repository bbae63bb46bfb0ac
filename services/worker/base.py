"""What prefill and decode workers share: a thin shell over the request ledger (what is held, and
what each event means for it: `ledger.py`), the engine (on its own thread: `compute.py`) and the bus.

Three loops run on the asyncio thread while the engine computes on its own thread: the engine loop
(here: step, publish, repeat while there is work; the decode worker queues the next step before
publishing), the pull loop (`pulling.py`: fetch as many queued messages as there is room for:
variable-size batches) and the report loop (`reports.py`). Every pulled message, of either role,
enters through `accept` and joins the engine through `admit` (`admission.py`): fetch what KV there
is (the role says where from), then `joining.join`. The roles decide what a step's outputs lead to (prefill: a
hand-off; decode: nothing more) and what happens at shutdown to the work that could not finish
within the grace period (prefill: back to the gateway; decode: handed on to another decode worker).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client

from ferry import metrics
from ferry.bus import Service, WorkConsumer, raise_if_cancelled, trace
from ferry.protocol import Cancel, ErrorEvent, GenerateRequest, OutputBatch, TrafficForecast, encode, subjects
from ferry.sched import BatchWhenBusy
from ferry_services.worker.admission import Admission
from ferry_services.worker.compute import ComputeThread
from ferry_services.worker.events import batch_by_gateway
from ferry_services.worker.group import group_metadata, is_group
from ferry_services.worker.handoff import HandoffSender
from ferry_services.worker.ledger import Effects, Held, RequestLedger, engine_id
from ferry_services.worker.pulling import Pulling, open_work_consumer
from ferry_services.worker.reports import Reporting, describe_engine
from ferry_services.worker.settings import WorkerSettings
from ferry_services.worker.slo import WorkerSlo
from ferry_services.worker.stats import WorkStats
from ferry_services.worker.streaming import TokenStream
from ferry_services.worker.window import AdmissionWindow
from ferry_services.worker.writeback import WriteBehind

log = logging.getLogger(__name__)

HALT_TIMEOUT_S = 5.0
"""Most time shutdown waits for the step in flight (and the publishing of its tokens) to end."""


class Worker(Admission, Pulling, Reporting, abc.ABC):
    role = ""
    work_type: type = object
    pipelined = False
    """Queue step N+1 before handling step N's outputs. Only where `after_step` needs nothing from
    the engine before the next step: the prefill worker takes its finished prefills off the engine
    right after a step, and a step queued first would delay every hand-off by one step."""
    kv_is_optional = True
    """The KV fetched for a message is a speed-up (prefill), not the sequence's own (decode): joining.py."""
    admits_in_pull_order = True
    """Admit each pulled message before taking the next (prefill: prompts queue in the engine in
    the order pulled); else admissions run side by side (decode: KV fetches overlap)."""
    acks_on_join = False
    """Settle a message once its sequence is in the engine (decode), not once it is handed on."""
    decodes = False
    """A prefill worker that decodes what it prefilled (both.py): its load reports say so."""

    def __init__(
        self, nc: Client, settings: WorkerSettings, engine: Any, store: Any, compute: ComputeThread | None = None
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.worker_id = settings.worker_id
        self.started_at = time.time()
        """In every load report: balancers tell a restarted worker (an empty pool) from the same id's last life."""
        self.engine = engine
        self.store = store
        self.namespace = store.namespace
        self.compute = compute or ComputeThread(engine)
        """The engine's thread; pass the one the engine was built on (compute.py says why)."""
        self.ledger = RequestLedger()
        is_cancelled = self.ledger.cancelled.__contains__
        self.handoffs = HandoffSender(
            nc, store, self.worker_id, settings.block_size, is_cancelled, settings.handoff_skip_stored
        )
        self.stream = TokenStream(nc, self.worker_id, settings.stream_interval_ms / 1000)
        """Token events out, held back per stream for FERRY_STREAM_INTERVAL_MS (coalesce.py)."""
        self.has_work = asyncio.Event()
        self.busy = BatchWhenBusy(settings.loop_sched_batch_from)
        """This (asyncio) thread's scheduling policy, by the sequences in a step: ferry.sched."""
        self.window = AdmissionWindow(
            settings.admission_window_ms / 1000 if self.admits_in_pull_order else 0.0,
            settings.admission_burst_ms / 1000,
        )
        """Prompts on their way to the engine, for the step that would start without them (window.py)."""
        self.arrivals = asyncio.Event()
        """Set when work is pulled or its addition queued: a held step looks again."""
        self.has_room = asyncio.Event()
        self.room_freed = asyncio.Event()
        """Set after every engine step and cancel: a hand-off waiting for free blocks tries again (admission.py)."""
        self.num_adding = 0
        """Engine additions queued on the engine thread and not finished: work for the engine loop."""
        self.is_halted = False
        """Shutting down: the engine loop steps no more."""
        self.parked = asyncio.Event()
        """Set by the engine loop once halted: no step queued, the last one's tokens published."""
        self.consumer: WorkConsumer | None = None
        self.tasks: set[asyncio.Task] = set()
        Reporting.__init__(self, describe_engine(engine, settings))
        self.service = Service(
            f"{self.role}-worker",
            description=f"ferry {self.role} worker",
            metadata={"worker_id": self.worker_id, "model": settings.model_name, **group_metadata(engine)},
        )
        self.service.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        self.slo = WorkerSlo(settings, self.role)  # the SLO controller (slo.py); off without FERRY_TPOT_SLO_MS
        self.service.subscribe(subjects.FORECAST_ALL, TrafficForecast, self.slo.on_forecast)
        self.work_stats = WorkStats(self)  # pulled work, steps, tokens, backlog in `nats micro stats`
        self.write_behind: WriteBehind | None = None
        """With FERRY_KV_WRITEBACK_DELAY_S > 0, roles that write finished sequences back (FERRY_KV_WRITEBACK)
        queue them here (writeback.py); else each is written at once."""

    def engine_is_busy(self) -> bool:
        """Sequences in the engine, or additions on their way to it."""
        return bool(self.num_adding) or self.engine.has_unfinished_requests()

    def start_write_back(self) -> None:
        """Finished sequences will be written back (FERRY_KV_WRITEBACK): at once, or with
        FERRY_KV_WRITEBACK_DELAY_S > 0 while the engine is idle (or once they waited that long)."""
        self.engine.remember_finished(4 * self.settings.max_running)
        if self.settings.kv_writeback_delay_s > 0:
            self.write_behind = WriteBehind(
                self.engine_is_busy, self.settings.kv_writeback_delay_s, 2 * self.settings.max_running
            )

    def queue_write_back(self, write: Callable[[], Awaitable[Any]]) -> None:
        """Run `write()` (a write-back) now, or behind the engine's work (write-behind, writeback.py)."""
        if self.write_behind is None:
            self.spawn(write())
        else:
            self.write_behind.add(write)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, consumer: WorkConsumer | None = None) -> None:
        """Take the work consumer opened before the model loaded (or open it now), its pulls counted."""
        self.consumer = self.work_stats.count(consumer or await open_work_consumer(self.js, self.settings))

    def background(self) -> list:
        loops = [self.engine_loop(), self.pull_loop(), self.report_loop()]
        return loops + ([self.write_behind.run()] if self.write_behind is not None else [])

    async def shutdown(self) -> None:
        """SIGTERM: stop pulling and tell the balancers, let what is here finish within the grace
        period, then move or give back the rest (`release`)."""
        self.ledger.draining = True
        await self.publish_report()
        grace_s = self.settings.shutdown_grace_s
        log.info("shutdown: draining, %d requests held, up to %.1f s for them to finish", len(self.ledger), grace_s)
        deadline = time.monotonic() + grace_s
        while len(self.ledger) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if self.write_behind is not None:  # what finished is written back before the engine goes
            await self.write_behind.flush()
        if len(self.ledger):
            await self.halt_engine()
            await self.release(self.ledger.release_all())
        if self.consumer is not None:
            await self.consumer.close()
        if is_group(self.engine):  # its ranks stop before the engine thread they are tied to ends
            await self.compute.call(self.engine.close)
        self.compute.close()
        self.stream.close()

    async def release(self, held: list[Held]) -> None:
        """What is still here at the end of the grace period goes back to the gateway, which
        resubmits it at once (`worker_lost` is retryable) instead of after this worker falls silent;
        its messages are acked, so no second copy runs. The decode worker moves its sequences instead."""
        for h in held:
            await self.publish_error(h.request, "worker_lost", f"{self.worker_id} shut down first", retryable=True)
        await self.apply(
            Effects(
                abort=[engine_id(h.request) for h in held if h.in_engine],
                ack=[h.handle for h in held if h.handle is not None],
            )
        )
        log.info("shutdown: %d requests given back to the gateway", len(held))

    # ---- the engine loop ---------------------------------------------------------------------
    async def engine_loop(self) -> None:
        queued: deque[asyncio.Future] = deque()  # steps already queued on the engine thread, oldest first
        depth = self.settings.pipeline_depth if self.pipelined else 1
        while True:
            raise_if_cancelled()
            if not queued:
                if self.is_halted or not (self.num_adding or self.engine.has_unfinished_requests()):
                    if self.is_halted:
                        self.parked.set()
                    self.has_work.clear()
                    await self.has_work.wait()
                    continue
                await self.hold_for_arrivals()
                queued.append(self.compute.submit_step(self.step))
            start = time.perf_counter()
            outputs = await queued[0]
            queued.popleft()
            self.busy.update(len(outputs))
            log.debug("step: %d outputs, waited %.1f ms for them", len(outputs), (time.perf_counter() - start) * 1000)
            if outputs and self.pipelined and not self.is_halted and self.engine.has_unfinished_requests():
                # the next step computes while this one's tokens are published: the engine thread
                # never waits for this loop (thread hops, encoding, other tasks) between two steps;
                # unless prompts are on their way (window.py): then it is queued once they have joined
                if not self.should_hold(0.0):
                    while len(queued) < depth:
                        queued.append(self.compute.submit_step(self.step))
            if outputs:  # sequences that produced a token this step (chunked prefills excluded)
                metrics.BATCH_SIZE.labels(self.role).observe(len(outputs))
            await self.after_step(outputs)
            self.has_room.set()
            self.room_freed.set()
            if not outputs:  # e.g. everything waits for blocks: do not spin on the engine thread
                await asyncio.sleep(0.001)

    async def hold_for_arrivals(self) -> None:
        """The admission window (window.py): while the next step would not fill its token budget and
        prompts are on their way to the engine, wait for them (at most FERRY_ADMISSION_WINDOW_MS); on an
        idle engine (a burst's first step) even past the budget, at most FERRY_ADMISSION_BURST_MS."""
        started, last_arrival = time.perf_counter(), -math.inf  # last_arrival: a request pulled during the hold
        is_idle = self.compute.stats.num_running == 0  # no step runs while this holds: it stays so
        num_arrived = self.window.num_arrived
        while True:
            now = time.perf_counter()
            held_s, quiet_s = now - started, now - last_arrival
            if not self.should_hold(held_s, is_idle, quiet_s):
                return
            self.arrivals.clear()
            timeout_s = self.window.limit_s(is_idle) - held_s
            if quiet_s < self.window.window_s:  # look again once the burst has been quiet for the window
                timeout_s = min(timeout_s, self.window.window_s - quiet_s)
            try:
                await asyncio.wait_for(self.arrivals.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
            if self.window.num_arrived != num_arrived:
                num_arrived, last_arrival = self.window.num_arrived, time.perf_counter()

    def should_hold(self, held_s: float, is_idle: bool = False, quiet_s: float = math.inf) -> bool:
        if self.window.window_s <= 0 or self.is_halted:
            return False
        can_pull = not self.ledger.draining and self.pull_budget() > 0
        stats = self.compute.stats
        return self.window.should_hold(
            held_s, can_pull, stats.num_queued_prefill_tokens, self.settings.max_batch_tokens, is_idle, quiet_s
        )

    async def halt_engine(self) -> None:
        """Stop stepping once the step in flight has ended and its tokens are published: from then
        on, what a sequence holds in the engine is exactly what its client has been sent."""
        self.is_halted = True
        self.has_work.set()
        try:
            await asyncio.wait_for(self.parked.wait(), HALT_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the engine loop did not stop within %.0f s", HALT_TIMEOUT_S)
        await self.stream.flush()  # every token the engine produced is with the gateway

    def step(self) -> Any:
        """Runs on the engine thread; with FERRY_TRACE_FILE, its start and end (and what it ran) in the trace."""
        if not trace.enabled():
            return self._run_step()
        trace.hop("*", f"{self.role[0]}w.step_start")
        before = getattr(self.engine, "last_step", None)
        outputs = self._run_step()
        record = getattr(self.engine, "last_step", None)
        sizes = {}
        if record is not None and record is not before:  # an empty step leaves the last record in place
            sizes = {"seqs": record.num_seqs, "prefill_tokens": record.num_prefill_tokens}
        trace.hop("*", f"{self.role[0]}w.step_end", outputs=len(outputs), **sizes)
        return outputs

    def _run_step(self) -> Any:
        self.slo.before_step(self.engine)
        outputs = self.engine.step()
        self.slo.after_step(self.engine)
        return outputs

    async def after_step(self, outputs: Any) -> None:
        await self.publish_outputs(outputs)
        for out in outputs:
            if out.finish_reason is not None:
                await self.apply(self.ledger.finished(out.request_id))

    async def publish_outputs(self, outputs: list) -> None:
        await self.stream.publish(batch_by_gateway(outputs, self.ledger.owner, self.worker_id))

    async def publish_error(self, request: GenerateRequest, code: str, message: str, retryable: bool) -> None:
        await self.stream.flush(request.request_id)  # its tokens held back go first
        error = ErrorEvent(request.request_id, code, message, retryable, attempt=request.attempt)
        await self.nc.publish(subjects.out(request.gateway_id), encode(OutputBatch(self.worker_id, errors=[error])))

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
        held_ids = [request_id for request_id in cancel.request_ids if request_id in self.ledger]
        effects = self.ledger.cancel(cancel.request_ids, cancel.below_attempt)
        for request_id in held_ids:
            if request_id not in self.ledger:
                log.info("cancelled %s (%s)", request_id, cancel.reason)
        await self.apply(effects)
        self.has_room.set()
        self.room_freed.set()

"""A worker's load reports (`ferry.load.<role>.<id>`, every FERRY_LOAD_INTERVAL_S), its Prometheus
gauges, and the leases of the messages it holds. Part of `Worker` (base.py): the report loop is
one of its three loops, and `load_report` is the one place a report is built.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from nats.aio.client import Client

from ferry import metrics
from ferry.bus import WorkConsumer, raise_if_cancelled
from ferry.protocol import LoadReport, encode, subjects
from ferry_services.worker.compute import ComputeThread
from ferry_services.worker.group import rank_loads
from ferry_services.worker.ledger import RequestLedger
from ferry_services.worker.settings import WorkerSettings
from ferry_services.worker.slo import WorkerSlo

log = logging.getLogger(__name__)

BACKLOG_TIMEOUT_S = 0.25
"""A report waits at most this long for JetStream's count of the worker's queued messages."""


class Reporting:
    """Mixed into `Worker`, which provides these:"""

    role: str
    decodes: bool
    worker_id: str
    started_at: float
    namespace: str
    settings: WorkerSettings
    nc: Client
    compute: ComputeThread
    ledger: RequestLedger
    engine: Any
    slo: WorkerSlo
    consumer: WorkConsumer | None

    def __init__(self, weights_dtype: str = "") -> None:
        self.weights_dtype = weights_dtype
        """What this worker's weight matmuls hold, as its reports and ferry_model_info say."""
        self._num_cached_reported = 0
        self.num_backlog = 0
        """Messages queued for this worker in JetStream, as of the last report."""

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
        for item in self.ledger.handles():
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
            num_waiting=stats.num_waiting + max(0, len(self.ledger) - in_engine),
            num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            max_running=self.engine.max_num_seqs,  # the SLO controller's cap when it runs
            block_size=self.settings.block_size,
            draining=self.ledger.draining,
            weights_dtype=self.weights_dtype,
            num_backlog=self.num_backlog,
            decodes=self.decodes,
            ranks=rank_loads(self.engine),
            started_at=self.started_at,
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
        self.slo.update_metrics(self.engine)


def describe_engine(engine, settings: WorkerSettings) -> str:
    """Sets ferry_model_info for the model the engine runs; -> its weights dtype ('' for an engine
    without a loaded model, as test doubles are)."""
    from ferry.model.describe import checkpoint_dtype, weights_dtype

    lm = getattr(engine, "lm", None)
    if lm is None:
        return ""
    dtype = weights_dtype(lm.model)
    labels = (settings.role, settings.model_name, lm.config.arch, dtype, checkpoint_dtype(lm.config))
    metrics.MODEL_INFO.labels(*labels).set(1)
    return dtype

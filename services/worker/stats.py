"""A worker's work in `nats micro stats <role>-worker`, per replica: the `work` input of its service.

Work reaches a worker by JetStream pull, not as a core-NATS request, so its micro service cannot
count it alone. `WorkStats.count(consumer)` wraps the worker's `WorkConsumer`: every pulled message
is one request on the `work` input, its processing time runs from the pull to its settling (ack,
nak or term, whichever comes first: how long the work stayed here), and a message that did not
decode (the consumer logs and terminates it) is one error. The input's `data` carries what the
engine did and holds: steps, tokens generated, mean batch size, running / waiting sequences, the
JetStream backlog and KV-cache usage, and `slo`: the batch cap in force and, with the SLO
controller on, its step-time model, chunk budget, forecast and desired replicas.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, TypeVar

from ferry.bus import EndpointStats, WorkConsumer, WorkItem
from ferry.protocol import subjects

if TYPE_CHECKING:
    from ferry_services.worker.base import Worker

M = TypeVar("M")


class WorkStats:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.counter = worker.service.input("work", subjects.work(worker.role, worker.worker_id), data=self.data)

    def count(self, consumer: WorkConsumer) -> CountedConsumer:
        return CountedConsumer(consumer, self.counter)

    def data(self) -> dict[str, Any]:
        """The `data` of the `work` endpoint in $SRV.STATS (read on the asyncio thread: snapshots only)."""
        engine = self.worker.compute.stats
        report = self.worker.load_report()
        data = {
            "num_steps": engine.num_steps,
            "num_generated_tokens": engine.num_generated_tokens,
            "mean_batch_size": round(engine.mean_batch_size, 3),
            "num_running": report.num_running,
            "num_waiting": report.num_waiting,
            "num_backlog": report.num_backlog,
            "num_queued_prefill_tokens": report.num_queued_prefill_tokens,
            "kv_blocks_used": report.kv_blocks_used,
            "kv_blocks_total": report.kv_blocks_total,
            "kv_usage": round(report.kv_usage, 4),
            "draining": report.draining,
            "host_kv_blocks": engine.num_host_blocks,
            "host_kv_hit_blocks": engine.num_host_hit_blocks,
            "num_partial_hit_tokens": engine.num_partial_hit_tokens,
            "slo": self.worker.slo.snapshot(self.worker.engine),
        }
        if report.ranks:  # a worker group: each rank's own load
            data["ranks"] = [dataclasses.asdict(rank) for rank in report.ranks]
        tiers = getattr(self.worker, "prefix_blocks_by_tier", None)
        if tiers is not None:  # a prefill worker: its admitted prompts' leading blocks, by tier
            data["prefix_blocks_by_tier"] = dict(tiers)
        return data


class CountedConsumer(WorkConsumer):
    """The worker's `WorkConsumer` (the same bound pull subscription), its pulls counted on a micro input."""

    def __init__(self, consumer: WorkConsumer, counter: EndpointStats) -> None:
        super().__init__(consumer._psub, consumer.name, consumer._js)
        self._counter = counter

    async def fetch(self, max_msgs: int, msg_type: type[M], timeout_s: float = 0.05) -> list[WorkItem[M]]:
        num_bad = self.num_bad
        items = await super().fetch(max_msgs, msg_type, timeout_s=timeout_s)
        for _ in range(self.num_bad - num_bad):  # logged and terminated by the consumer
            self._counter.record(0, error=f"bad_request: a message on {self.name} is not a {msg_type.__name__}")
        return [CountedItem.of(item, self._counter) for item in items]


class CountedItem(WorkItem):
    """A pulled message that records its time here on the `work` input when it is first settled."""

    __slots__ = ("_counter", "_pulled_ns")
    _counter: EndpointStats
    _pulled_ns: int

    @classmethod
    def of(cls, item: WorkItem, counter: EndpointStats) -> CountedItem:
        counted = cls(msg=item.msg, raw=item.raw, num_delivered=item.num_delivered, num_pending=item.num_pending)
        counted._counter, counted._pulled_ns = counter, time.perf_counter_ns()
        return counted

    async def ack(self) -> None:
        await WorkItem.ack(self)
        self._settled()

    async def nak(self, delay_s: float | None = None) -> None:
        await WorkItem.nak(self, delay_s)
        self._settled()

    async def term(self) -> None:
        await WorkItem.term(self)
        self._settled()

    def _settled(self) -> None:
        if self._pulled_ns:  # once: a second settle of the same message changes nothing on the server
            self._counter.record(time.perf_counter_ns() - self._pulled_ns)
            self._pulled_ns = 0

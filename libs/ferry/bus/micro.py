"""NATS micro registration of a ferry `Service`, on nats-py's own `nats.micro`.

`nats.micro.Service` gives each instance its id, answers `$SRV.PING`, `$SRV.INFO` and `$SRV.STATS` on
the three subjects each (all services, every instance of this name, this instance) with the JSON the
`nats micro` CLI reads; `ServiceConfig.stats_handler` fills each endpoint's `data` in STATS.

What it lists as endpoints comes from ferry, not from `nats.micro.Endpoint`, because ferry needs what
that class cannot do: an error reply that carries an `ErrorReply` body (its error path sends headers
only, and ferry's clients decode the body), a stop that drains (it unsubscribes, dropping messages
already queued), subscriptions without a queue group (load reports and cancels reach every replica:
it always joins one), and inputs that are not subscriptions at all (JetStream pulls, whose counts the
owner records). So ferry keeps one `EndpointStats` per endpoint, subscription or input, and
`MicroRegistration` overrides `stats()` and `info()`, the two methods whose results nats.micro
serializes, to report them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from nats.aio.client import Client
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER
from nats.micro.service import EndpointInfo, ServiceConfig, ServiceInfo, ServiceStats
from nats.micro.service import EndpointStats as MicroEndpointStats
from nats.micro.service import Service as MicroService

__all__ = ["ERROR_CODE_HEADER", "ERROR_HEADER", "Counters", "MicroRegistration"]

log = logging.getLogger("ferry.bus")


class Counters(Protocol):
    """What a ferry endpoint, subscription or input reports (ferry.bus.service.EndpointStats)."""

    name: str
    subject: str
    queue_group: str
    kind: str
    num_requests: int
    num_errors: int
    last_error: str
    processing_time_ns: int


class MicroRegistration(MicroService):
    """A nats.micro service whose endpoints are ferry's counters, read afresh at every STATS / INFO."""

    def __init__(self, nc: Client, config: ServiceConfig, counters: Callable[[], Iterable[Counters]]) -> None:
        super().__init__(nc, config)
        self._counters = counters
        self._stats_handler_of_config = config.stats_handler
        # nats.micro swaps an empty metadata dict for a new one; ferry's dict must stay the live one
        # (kvcache flips `degraded` in it while running), so PING/INFO/STATS always read the same object.
        self._metadata = config.metadata if config.metadata is not None else {}

    def stats(self) -> ServiceStats:
        stats = super().stats()  # identity, started, metadata; the endpoints are ferry's
        stats.endpoints = [_micro_stats(c) for c in self._counters()]
        if self._stats_handler_of_config is not None:  # what nats.micro does for its own endpoints
            for endpoint in stats.endpoints:
                endpoint.data = self._stats_handler_of_config(endpoint)
        return stats

    def info(self) -> ServiceInfo:
        info = super().info()
        info.endpoints = [
            EndpointInfo(name=c.name, subject=c.subject, queue_group=c.queue_group, metadata={"kind": c.kind})
            for c in self._counters()
        ]
        return info

    async def stop(self) -> None:
        try:
            await super().stop()
        except Exception:  # connection already closed: nothing left to unregister from
            log.debug("micro stop of %s failed", self._name, exc_info=True)


def _micro_stats(c: Counters) -> MicroEndpointStats:
    return MicroEndpointStats(
        name=c.name,
        subject=c.subject,
        queue_group=c.queue_group,
        num_requests=c.num_requests,
        num_errors=c.num_errors,
        last_error=c.last_error,
        processing_time=c.processing_time_ns,
        average_processing_time=c.processing_time_ns // c.num_requests if c.num_requests else 0,
    )

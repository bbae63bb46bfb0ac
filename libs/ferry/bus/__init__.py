"""NATS for ferry services: connect, typed micro services, JetStream work queues, the runner.

See docs/internals.md ("Bus") for the API and the entry-point pattern every service follows.
"""

from ferry.bus.connect import connect, drain_or_close
from ferry.bus.runner import raise_if_cancelled, run_service
from ferry.bus.service import BusError, EndpointStats, Service
from ferry.bus.workqueue import (
    WorkConsumer,
    WorkItem,
    delete_work_consumer,
    ensure_work_consumer,
    ensure_work_stream,
    publish_work,
    work_stream_config,
)

__all__ = [
    "BusError",
    "EndpointStats",
    "Service",
    "WorkConsumer",
    "WorkItem",
    "connect",
    "delete_work_consumer",
    "drain_or_close",
    "ensure_work_consumer",
    "ensure_work_stream",
    "publish_work",
    "raise_if_cancelled",
    "run_service",
    "work_stream_config",
]

"""NATS micro discovery for a ferry `Service`: answers `$SRV.PING`, `$SRV.INFO` and `$SRV.STATS`.

Each verb is served on three subjects (all services, every instance of this name, this instance),
with the JSON bodies of the micro protocol (io.nats.micro.v1.*). The payload classes come from
nats-py's `nats.micro`, so the JSON is exactly what the `nats micro` CLI reads; the endpoint
handling is ferry's own, because ferry counts decode errors and answers with `ErrorReply`.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER
from nats.micro.service import (
    EndpointInfo,
    ServiceInfo,
    ServicePing,
    ServiceStats,
    ServiceVerb,
    control_subject,
)
from nats.micro.service import EndpointStats as MicroEndpointStats
from nats.nuid import NUID

if TYPE_CHECKING:
    from ferry.bus.service import Service

__all__ = ["ERROR_CODE_HEADER", "ERROR_HEADER", "Control", "ServiceVerb", "control_subject"]

log = logging.getLogger("ferry.bus")


class Control:
    """The `$SRV.*` subscriptions of one service instance."""

    def __init__(self, nc: Client, service: Service) -> None:
        self.nc = nc
        self.service = service
        self.id = NUID().next().decode()  # the id scheme nats.micro uses: unique per instance
        self.started = datetime.now(timezone.utc)
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        answers = {ServiceVerb.PING: self.ping, ServiceVerb.INFO: self.info, ServiceVerb.STATS: self.stats}
        for verb, answer in answers.items():
            for name, instance_id in ((None, None), (self.service.name, None), (self.service.name, self.id)):
                subject = control_subject(verb, name=name, id=instance_id)
                self._subscriptions.append(await self.nc.subscribe(subject, cb=self._responder(answer)))

    async def stop(self) -> None:
        subscriptions, self._subscriptions = self._subscriptions, []
        for sub in subscriptions:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed
                log.debug("unsubscribe of %s failed", sub.subject, exc_info=True)

    def _responder(self, answer):
        async def respond(msg: Msg) -> None:
            if not msg.reply:
                return
            try:
                await self.nc.publish(msg.reply, json.dumps(answer()).encode())
            except Exception:  # never let discovery take the service down
                log.warning("could not answer %s", msg.subject, exc_info=True)

        return respond

    def ping(self) -> dict:
        s = self.service
        return ServicePing(id=self.id, name=s.name, version=s.version, metadata=s.metadata).to_dict()

    def info(self) -> dict:
        s = self.service
        endpoints = [
            EndpointInfo(name=e.name, subject=e.subject, queue_group=e.queue_group, metadata={"kind": e.kind})
            for e in s.stats().values()
        ]
        return ServiceInfo(
            name=s.name,
            id=self.id,
            version=s.version,
            description=s.description,
            endpoints=endpoints,
            metadata=s.metadata,
        ).to_dict()

    def stats(self) -> dict:
        s = self.service
        endpoints = [
            MicroEndpointStats(
                name=e.name,
                subject=e.subject,
                queue_group=e.queue_group,
                num_requests=e.num_requests,
                num_errors=e.num_errors,
                last_error=e.last_error,
                processing_time=e.processing_time_ns,
                average_processing_time=e.processing_time_ns // e.num_requests if e.num_requests else 0,
            )
            for e in s.stats().values()
        ]
        return ServiceStats(
            id=self.id, name=s.name, version=s.version, started=self.started, endpoints=endpoints, metadata=s.metadata
        ).to_dict()

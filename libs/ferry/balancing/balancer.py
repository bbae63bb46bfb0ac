"""The shape both balancers share: a NATS micro service that holds the balancer's own endpoint, the
runtime's inputs (load reports, re-routed work) and, for the prefill-balancer, KV events.

A subclass names its role and work message, registers its endpoint, and supplies its policy: the
endpoint handler and `reroute` (where a silent worker's queued message goes).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from typing import ClassVar, Generic, TypeVar

from nats.aio.client import Client

from ferry.balancing.arrivals import ArrivalForecast
from ferry.balancing.runtime import BalancerRuntime
from ferry.balancing.settings import BalancerSettings
from ferry.bus import Service, connect, ensure_work_stream, run_service
from ferry.metrics import start_metrics_server
from ferry.slo import ForecastConfig

W = TypeVar("W")


class Balancer(abc.ABC, Generic[W]):
    name: ClassVar[str]
    """The micro service name (`nats micro stats <name>`), also the NATS connection's name."""
    role: ClassVar[str]
    """The workers it places work on: 'prefill' or 'decode'."""
    work_type: ClassVar[type]
    """The message it queues on `ferry.work.<role>.<worker>`."""
    description: ClassVar[str]

    def __init__(self, nc: Client, settings: BalancerSettings) -> None:
        self.nc = nc
        self.service = Service(self.name, description=self.description)
        self.runtime: BalancerRuntime[W] = BalancerRuntime(
            nc,
            self.service,
            self.role,
            self.work_type,
            self.reroute,
            silent_after_intervals=settings.silent_after_intervals,
            tick_s=settings.tick_s,
        )
        forecast = ForecastConfig(settings.forecast_interval_s, settings.forecast_season_intervals)
        self.arrivals = ArrivalForecast(self.name, forecast, settings.forecast_publish_s)
        """What this balancer places, forecast and published on ferry.forecast.<name>-<id> (arrivals.py)."""

    @abc.abstractmethod
    async def reroute(self, work: W) -> bool:
        """Place one message of a silent worker's queue on a live worker; False when none can take it now."""

    async def start(self) -> None:
        """Serve in this process until `stop` (tests, benchmarks); `serve_balancer` runs it as a service."""
        await self.service.start(self.nc)
        await self.runtime.start()
        self._publisher = asyncio.create_task(self.arrivals.publish_loop(self.nc, lambda: self.service.id))
        await self.on_serving()

    async def on_serving(self) -> None:
        """Runs once its subscriptions are live (the prefill-balancer asks for its index here)."""

    async def _serving(self) -> None:
        await self.on_serving()

    async def stop(self) -> None:
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher
        await self.service.stop()
        await self.runtime.stop()


async def serve_balancer(cls: type[Balancer], settings: BalancerSettings) -> int:
    """Run one balancer until SIGTERM/SIGINT; the exit status."""
    nc = await connect(settings.nats_url, cls.name)
    await ensure_work_stream(nc.jetstream(), replicas=settings.work_replicas)
    balancer = cls(nc, settings)
    start_metrics_server(settings.metrics_port)
    runtime = balancer.runtime
    background = [runtime.run(), balancer._serving(), balancer.arrivals.publish_loop(nc, lambda: balancer.service.id)]
    return await run_service(nc, balancer.service, background=background, on_shutdown=runtime.stop)

"""A balancer's own arrival forecast: what it places (prompt tokens, max_tokens) is counted by a
TrafficForecaster and published every FERRY_FORECAST_PUBLISH_S as a TrafficForecast on
`ferry.forecast.<balancer name>-<instance id>`, as the gateways do. Workers prefer the forecast of
the balancers of their own role (what reaches that role, after the prefix cache and the gateways'
rejections) and fall back to the gateways' (ferry_services.worker.slo.pick_forecasts)."""

from __future__ import annotations

import asyncio
import logging
import time

from ferry import metrics
from ferry.protocol import encode, subjects
from ferry.slo import ForecastConfig, TrafficForecaster

log = logging.getLogger(__name__)


class ArrivalForecast:
    def __init__(self, name: str, config: ForecastConfig | None = None, publish_s: float = 5.0) -> None:
        self.name = name
        self.forecaster = TrafficForecaster(config or ForecastConfig(), source=name)
        self.publish_s = publish_s

    def observe(self, num_prompt_tokens: int, num_output_tokens: int, now_s: float | None = None) -> None:
        self.forecaster.observe(time.time() if now_s is None else now_s, num_prompt_tokens, num_output_tokens)

    async def publish(self, nc, instance_id: str, now_s: float | None = None) -> None:
        """One forecast out, its source named by the balancer and its instance (replicas add up)."""
        source = f"{self.name}-{instance_id}" if instance_id else self.name
        self.forecaster.source = source
        forecast = self.forecaster.forecast(time.time() if now_s is None else now_s)
        metrics.FORECAST_RPS.labels(source, "rate").set(forecast.rate_rps)
        metrics.FORECAST_RPS.labels(source, "forecast").set(forecast.forecast_rps)
        await nc.publish(subjects.forecast(source), encode(forecast))

    async def publish_loop(self, nc, instance_id) -> None:
        """instance_id: a callable giving the instance id (known once the service has started)."""
        while True:
            await asyncio.sleep(self.publish_s)
            try:
                await self.publish(nc, instance_id())
            except Exception:  # reconnecting: the next one goes out
                log.debug("forecast not published", exc_info=True)

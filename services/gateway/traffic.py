"""What the gateway measures for SLO-driven batching: arrivals and their forecast, and SLO outcomes.

Every accepted request is an arrival (prompt tokens, max_tokens) for a TrafficForecaster; every
FERRY_FORECAST_PUBLISH_S the forecast goes out on `ferry.forecast.gateway-<id>` (workers size
their batch caps and desired replicas from it) and into ferry_forecast_requests_per_second. A
finished request counts in ferry_slo_requests_total by outcome against FERRY_TTFT_SLO_MS and
FERRY_TPOT_SLO_MS (TPOT: the request's mean gap between tokens after the first).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ferry import metrics
from ferry.protocol import GenerateRequest, encode, subjects
from ferry.slo import ForecastConfig, TrafficForecaster

log = logging.getLogger(__name__)


def slo_outcome(ttft_s: float, tpot_s: float | None, ttft_slo_ms: float, tpot_slo_ms: float) -> str:
    """met, ttft_missed, tpot_missed or both_missed; a one-token answer has no TPOT to miss."""
    ttft_ok = ttft_s * 1000 <= ttft_slo_ms
    tpot_ok = tpot_s is None or tpot_s * 1000 <= tpot_slo_ms
    if ttft_ok and tpot_ok:
        return "met"
    if tpot_ok:
        return "ttft_missed"
    return "tpot_missed" if ttft_ok else "both_missed"


class GatewayTraffic:
    def __init__(
        self,
        gateway_id: str,
        ttft_slo_ms: float = 2000.0,
        tpot_slo_ms: float = 0.0,
        forecast: ForecastConfig | None = None,
        publish_s: float = 5.0,
    ) -> None:
        self.source = f"gateway-{gateway_id}"
        self.ttft_slo_ms, self.tpot_slo_ms = ttft_slo_ms, tpot_slo_ms
        self.forecaster = TrafficForecaster(forecast or ForecastConfig(), source=self.source)
        self.publish_s = publish_s

    def on_accepted(self, request: GenerateRequest) -> None:
        num_prompt = len(request.prompt_token_ids) + len(request.output_token_ids)
        self.forecaster.observe(time.time(), num_prompt, request.sampling.max_tokens)

    def on_finished(self, ttft_s: float, tpot_s: float | None) -> None:
        """Counts the outcome when a TPOT target is set (FERRY_TPOT_SLO_MS > 0)."""
        if self.tpot_slo_ms > 0:
            metrics.SLO_REQUESTS.labels(slo_outcome(ttft_s, tpot_s, self.ttft_slo_ms, self.tpot_slo_ms)).inc()

    async def publish_loop(self, nc) -> None:
        while True:
            await asyncio.sleep(self.publish_s)
            try:
                await self.publish(nc)
            except Exception:  # reconnecting: the next one goes out
                log.debug("forecast not published", exc_info=True)

    async def publish(self, nc) -> None:
        forecast = self.forecaster.forecast(time.time())
        metrics.FORECAST_RPS.labels(self.source, "rate").set(forecast.rate_rps)
        metrics.FORECAST_RPS.labels(self.source, "forecast").set(forecast.forecast_rps)
        await nc.publish(subjects.forecast(self.source), encode(forecast))

"""A worker's SLO controller (FERRY_TPOT_SLO_MS > 0 and no FERRY_MAX_NUM_SEQS): before every step
the cap and chunk budget the targets allow, after every step the step-time model learns from it.

The token mix and the system's arrival rate come from the TrafficForecasts on `ferry.forecast.>`
(the latest of each source; pick_forecasts: the balancers of this worker's role if any publish,
else the gateways; those combined: rates add), else from the requests this worker pulls.
What it decides shows in the worker's load reports (`max_running`:
the balancers route with the cap in view), its micro stats (`slo` in the work input's data) and
Prometheus (ferry_batch_cap, ferry_chunk_budget_tokens, ferry_step_model_ms,
ferry_desired_replicas). With a fixed cap it only reports that cap.
"""

from __future__ import annotations

import time
from typing import Any

from ferry import metrics
from ferry.engine.adaptive import AdaptiveLimits
from ferry.protocol import GenerateRequest, TrafficForecast
from ferry.slo import ControllerLimits, SloTargets, TokenMix, combine
from ferry_services.worker.settings import WorkerSettings

ROLE_SOURCES = {"prefill": "prefill-balancer-", "decode": "decode-balancer-"}
"""Whose forecast describes what reaches a role best: its own balancers'."""

STALE_INTERVALS = 3
"""A source's forecast older than this many of its intervals is dropped (that gateway is gone)."""


def pick_forecasts(forecasts: list[TrafficForecast], role: str) -> list[TrafficForecast]:
    """The forecasts to combine for a worker of this role: its own balancers' if any publish, else
    the gateways', else all. Never two kinds at once: a request counted by a gateway and again by a
    balancer would count twice."""
    for prefix in (ROLE_SOURCES.get(role), "gateway-"):
        chosen = [f for f in forecasts if prefix and f.source.startswith(prefix)]
        if chosen:
            return chosen
    return forecasts


class WorkerSlo:
    def __init__(self, settings: WorkerSettings, role: str) -> None:
        self.role = role
        self.adaptive: AdaptiveLimits | None = None
        self._forecasts: dict[str, TrafficForecast] = {}
        if settings.is_adaptive:
            limits = ControllerLimits(
                max_num_seqs=settings.max_running,
                fixed_num_seqs=settings.max_running,
                max_chunk_tokens=settings.max_batch_tokens,
                fixed_chunk_tokens=settings.max_batch_tokens,
                min_chunk_tokens=min(16, settings.max_batch_tokens),
                min_num_seqs=min(4, settings.max_running),
            )
            targets = SloTargets(tpot_ms=settings.tpot_slo_ms, ttft_ms=settings.ttft_slo_ms)
            self.adaptive = AdaptiveLimits(targets, limits, role=role)

    # ---- engine thread ---------------------------------------------------------------------------
    def before_step(self, engine: Any) -> None:
        if self.adaptive is not None:
            self.adaptive.before_step(engine, time.time())  # the engine's arrival_time clock

    def after_step(self, engine: Any) -> None:
        if self.adaptive is not None:
            self.adaptive.after_step(engine)

    # ---- asyncio loop ----------------------------------------------------------------------------
    def on_pulled(self, request: GenerateRequest) -> None:
        """A request reached this worker: the local arrivals, used while no forecast is published."""
        if self.adaptive is not None:
            num_prompt = len(request.prompt_token_ids) + len(request.output_token_ids)
            self.adaptive.observe_arrival(time.time(), num_prompt, request.sampling.max_tokens)

    async def on_forecast(self, forecast: TrafficForecast) -> None:
        self._forecasts[forecast.source] = forecast
        now = time.time()
        for source, f in list(self._forecasts.items()):
            if now - f.timestamp > STALE_INTERVALS * f.interval_s:
                del self._forecasts[source]
        combined = combine(pick_forecasts(list(self._forecasts.values()), self.role))
        if self.adaptive is not None and combined is not None and combined.num_requests:
            mix = TokenMix(combined.mean_prompt_tokens, combined.mean_output_tokens)
            self.adaptive.set_forecast(mix, combined.forecast_rps)

    def snapshot(self, engine: Any) -> dict[str, Any]:
        """The `slo` entry of the worker's micro stats data."""
        base = {"adaptive": self.adaptive is not None, "max_num_seqs": engine.max_num_seqs}
        return base if self.adaptive is None else {**base, **self.adaptive.snapshot()}

    def update_metrics(self, engine: Any) -> None:
        metrics.BATCH_CAP.labels(self.role).set(engine.max_num_seqs)
        if self.adaptive is None:
            return
        snap = self.adaptive.snapshot()
        metrics.CHUNK_BUDGET.labels(self.role).set(snap["chunk_tokens"] or 0)
        metrics.DESIRED_REPLICAS.labels(self.role).set(snap["desired_replicas"])
        model = snap["step_model"]
        for term, value in model["coefficients_ms"].items():
            metrics.STEP_MODEL.labels(self.role, term).set(value)
        metrics.STEP_MODEL.labels(self.role, "residual").set(model["residual_ms"])
        metrics.STEP_MODEL.labels(self.role, "predicted_step").set(snap["predicted_step_ms"] or 0)

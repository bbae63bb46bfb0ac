"""AdaptiveLimits: an engine's batch cap and chunk budget set before every step by the SLO controller.

The driver around an engine (a worker, the trace benchmark) calls `observe_arrival` for each
request it receives, `before_step(engine, now_s)` right before `engine.step()` and
`after_step(engine)` right after; now_s is on the clock of the requests' arrival_time (the
engine's default: time.time()). The step-time model learns from `engine.last_step`; the token
mix and rate come from the forecaster fed by the arrivals (or from outside: `set_forecast`, e.g.
a published TrafficForecast). Roles: 'both' and 'decode' get a decode cap (with, for 'both', the steady-state
share of prefill in every step) and a chunk budget that keeps the step in the TPOT target;
'prefill' keeps its cap and gets the chunk that keeps a step within half the TTFT target.
No torch here: the engine is used only through set_limits, decode_load and last_step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.slo import (
    ControllerLimits,
    ForecastConfig,
    Plan,
    SloController,
    SloTargets,
    StepTimeModel,
    TokenMix,
    TrafficForecaster,
)
from ferry.slo.step_model import StepRecord


@dataclass(slots=True)
class LimitsSample:
    """One decision, for the cap-over-time record."""

    time_s: float
    max_num_seqs: int
    chunk_tokens: int
    desired_replicas: int


class AdaptiveLimits:
    def __init__(
        self,
        targets: SloTargets,
        limits: ControllerLimits | None = None,
        role: str = "both",
        forecast: ForecastConfig | None = None,
        keep_history: bool = False,
    ) -> None:
        self.role = role
        self.model = StepTimeModel()
        self.controller = SloController(self.model, targets, limits)
        self.forecaster = TrafficForecaster(forecast or ForecastConfig())
        self.plan: Plan | None = None
        self.desired_replicas = 1
        """Replicas like this one that the forecast needs within the targets (see SloController)."""
        self.history: list[LimitsSample] | None = [] if keep_history else None
        self._outside: tuple[TokenMix, float] | None = None
        self._last_seen: StepRecord | None = None

    def observe_arrival(self, now_s: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.forecaster.observe(now_s, num_prompt_tokens, num_output_tokens)

    def set_forecast(self, mix: TokenMix, forecast_rps: float) -> None:
        """Use this forecast (a published TrafficForecast of the whole system) instead of the
        arrivals seen here."""
        self._outside = (mix, forecast_rps)

    @property
    def mix(self) -> TokenMix:
        if self._outside is not None:
            return self._outside[0]
        fc = self.forecaster
        return TokenMix(fc.mean_prompt_tokens, fc.mean_output_tokens) if fc.num_requests else TokenMix()

    @property
    def forecast_rps(self) -> float:
        return self._outside[1] if self._outside is not None else self.forecaster.peak_rps()

    def before_step(self, engine, now_s: float) -> None:
        self.forecaster.advance(now_s)
        mix = self.mix
        if self.role == "prefill":
            self.plan = self.controller.prefill_plan(mix)
            cap, chunk, budget = engine.config.max_num_seqs, self.plan.chunk_tokens, self.plan.chunk_tokens
        else:
            self.plan = self.controller.decode_plan(mix, prefill_in_steps=self.role == "both")
            num_decoding, num_context = engine.decode_load()
            backlog = engine.prefill_backlog()
            cap = self.plan.max_num_seqs
            chunk = self.controller.chunk_budget(num_decoding, num_context, backlog, now_s)
            budget = num_decoding + chunk
        engine.set_limits(max_num_seqs=cap, max_num_batched_tokens=budget)
        self.desired_replicas = self.controller.desired_replicas(self.forecast_rps, self.plan, self.desired_replicas)
        if self.history is not None:
            self.history.append(LimitsSample(now_s, cap, chunk, self.desired_replicas))

    def after_step(self, engine) -> None:
        record = engine.last_step
        if record is not None and record is not self._last_seen:
            self.model.observe(record)
            self._last_seen = record

    def snapshot(self) -> dict:
        """The step model, the decision in force and its prediction: for micro stats and metrics."""
        plan = self.plan
        return {
            "step_model": self.model.snapshot(),
            "max_num_seqs": plan.max_num_seqs if plan else None,
            "chunk_tokens": plan.chunk_tokens if plan else None,
            "predicted_step_ms": round(plan.predicted_step_ms, 3) if plan else None,
            "capacity_rps": round(plan.capacity_rps, 4) if plan else None,
            "forecast_rps": round(self.forecast_rps, 4),
            "desired_replicas": self.desired_replicas,
        }

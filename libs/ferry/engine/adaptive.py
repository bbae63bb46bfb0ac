"""AdaptiveLimits: an engine's batch cap and chunk budget set before every step by the SLO controller.

The driver around an engine (a worker, the trace benchmark) calls `observe_arrival` for each
request it receives, `before_step(engine, now_s)` right before `engine.step()` and
`after_step(engine)` right after; now_s is on the clock of the requests' arrival_time (the
engine's default: time.time()). The step-time model learns from `engine.last_step`; the token
mix and rate come from the forecaster fed by the arrivals (or from outside: `set_forecast`, e.g.
a published TrafficForecast). Roles: 'both' and 'decode' get a decode cap (with, for 'both', the steady-state
share of prefill in every step) and a chunk budget that keeps the step in the TPOT target;
'prefill' keeps its cap and gets the chunk that keeps a step within half the TTFT target.

The planned cap goes through a CapSmoother (hysteresis: ControllerLimits.cap_band, cap_hold_steps)
before admission adds its seats. What the controller plans with is what the engine holds NOW where
it can: the token mix of the requests waiting and running (prompt lengths are known at arrival,
output limits too) once at least MIN_PRESENT are there, else the forecaster's EWMA over past
arrivals; the arrival rate (how much prefill a step carries below saturation) is the forecast's
peak. With `admission` (the default), SloController.admit also reorders the waiting queue (prompts
that can still meet the TTFT target first, the late behind them), sizes the chunk from the running
decodes' TPOT slack and raises the cap for on-time prompts it would hold past their TTFT target
(when that keeps the running requests' TPOT, or loses fewer than it saves); a running decode's
first-token time is taken as the first before_step that sees it decoding. No torch here: the engine
is used only through set_limits, reorder_waiting, prompts, running_decodes, decode_load and
last_step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ferry.slo import (
    CapSmoother,
    ControllerLimits,
    ForecastConfig,
    Plan,
    QueuedPrompt,
    RunningDecode,
    SloController,
    SloTargets,
    StepTimeModel,
    TokenMix,
    TrafficForecaster,
)
from ferry.slo.step_model import StepRecord

MIN_PRESENT = 4
"""Requests waiting and running from which their own token mix replaces the forecaster's."""


@dataclass(slots=True)
class LimitsSample:
    """One decision, for the cap-over-time record."""

    time_s: float
    max_num_seqs: int
    chunk_tokens: int
    desired_replicas: int
    num_late: int = 0
    """Waiting prompts the controller put behind the others (past saving for the TTFT target)."""
    planned_num_seqs: int = 0
    """The cap the controller planned this step, before the smoothing (max_num_seqs: after the
    smoothing and the seats admission added)."""
    smoothed_num_seqs: int = 0
    """The planned cap after the smoothing (CapSmoother), before the seats."""


class AdaptiveLimits:
    def __init__(
        self,
        targets: SloTargets,
        limits: ControllerLimits | None = None,
        role: str = "both",
        forecast: ForecastConfig | None = None,
        keep_history: bool = False,
        admission: bool = True,
        fixed_cap: int | None = None,
    ) -> None:
        if fixed_cap is not None and fixed_cap < 1:
            raise ValueError(f"AdaptiveLimits.fixed_cap={fixed_cap}: must be >= 1")
        self.role = role
        self.admission = admission
        self.fixed_cap = fixed_cap
        """Hold a decoding role's cap here (no plan, no smoothing, no seats beyond it): the SLO
        admission with a fixed cap, the baseline that tells what the adaptive cap adds."""
        self.model = StepTimeModel()
        self.controller = SloController(self.model, targets, limits)
        lim = self.controller.limits
        self.smoother = CapSmoother(lim.cap_band, lim.cap_hold_steps)
        self._planned = (0, 0)
        """(planned, smoothed) cap of the last decode plan, for the history."""
        self.forecaster = TrafficForecaster(forecast or ForecastConfig())
        self.plan: Plan | None = None
        self.desired_replicas = 1
        """Replicas like this one that the forecast needs within the targets (see SloController)."""
        self.history: list[LimitsSample] | None = [] if keep_history else None
        self._outside: tuple[TokenMix, float] | None = None
        self._last_seen: StepRecord | None = None
        self._first_token: dict[str, tuple[float, int]] = {}
        """Running decode -> (first seen decoding at, its output tokens then)."""

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
        if self.role == "prefill":
            plan = self.plan = self.controller.prefill_plan(self.mix)
            cap, chunk, budget, num_late = engine.config.max_num_seqs, plan.chunk_tokens, plan.chunk_tokens, 0
        else:
            plan, chunk, num_late = self._decode_limits(engine, now_s)
            cap, budget = plan.max_num_seqs, len(self._first_token) + chunk
        engine.set_limits(max_num_seqs=cap, max_num_batched_tokens=budget)
        self.desired_replicas = self.controller.desired_replicas(self.forecast_rps, plan, self.desired_replicas)
        if self.history is not None:
            planned, smoothed = self._planned
            self.history.append(LimitsSample(now_s, cap, chunk, self.desired_replicas, num_late, planned, smoothed))

    def _decode_limits(self, engine, now_s: float) -> tuple[Plan, int, int]:
        """(plan, chunk budget, late prompts) of a decoding role; reorders the queue with admission."""
        waiting, head, running = engine.prompts(), engine.prompts(waiting=False), engine.running_decodes()
        self._track_first_tokens(running, now_s)
        mix = self.mix_now(waiting, head, running)
        plan = self.controller.decode_plan(mix, self.role == "both", self.forecast_rps)
        if self.fixed_cap is not None:
            smoothed = self.fixed_cap
        elif plan.is_model_ready:
            smoothed = self.smoother.update(plan.max_num_seqs)
        else:
            smoothed = plan.max_num_seqs
        self._planned = (plan.max_num_seqs, smoothed)
        plan = self.plan = replace(plan, max_num_seqs=smoothed)
        num_decoding, num_context = engine.decode_load()
        if not self.admission:
            return plan, self.controller.chunk_budget(num_decoding, num_context, engine.prefill_backlog(), now_s), 0
        decodes = [
            RunningDecode(rid, self._first_token[rid][0], num_out - self._first_token[rid][1], left)
            for rid, _, num_out, left in running
        ]
        queue = [QueuedPrompt(rid, arrival, tokens) for rid, arrival, tokens, _ in waiting]
        head_prompts = [QueuedPrompt(rid, arrival, tokens) for rid, arrival, tokens, _ in head]
        decision = self.controller.admit(queue, decodes, num_context, now_s, head_prompts, plan.max_num_seqs)
        if decision.num_late:
            engine.reorder_waiting([p.key for p in decision.order])
        seats = decision.max_num_seqs if self.fixed_cap is None else None
        if seats is not None and seats != plan.max_num_seqs:
            plan = self.plan = replace(plan, max_num_seqs=seats)
        return plan, decision.chunk_tokens, decision.num_late

    def _track_first_tokens(self, running: list[tuple[str, int, int, int]], now_s: float) -> None:
        seen = self._first_token
        self._first_token = {rid: seen.get(rid) or (now_s, num_out) for rid, _, num_out, _ in running}

    def mix_now(self, waiting, head, running) -> TokenMix:
        """The token mix of the requests in the engine now (engine.prompts / running_decodes
        tuples); the forecaster's (self.mix) while fewer than MIN_PRESENT are there."""
        prompts = [tokens for _, _, tokens, _ in (*waiting, *head)] + [p for _, p, _, _ in running]
        outputs = [left for _, _, _, left in (*waiting, *head)] + [out + left for _, _, out, left in running]
        if len(prompts) < MIN_PRESENT:
            return self.mix
        return TokenMix(sum(prompts) / len(prompts), sum(outputs) / len(outputs))

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

"""SLO-driven batching: a step-time model learned online, a traffic forecast and the controller
that turns both into batch caps, prefill chunk budgets and desired replicas. Pure: no NATS, no
torch; imports only ferry.protocol (the TrafficForecast message)."""

from ferry.slo.admission import QueuedPrompt, RunningDecode, on_time_order, tpot_slack_ms
from ferry.slo.controller import SloController
from ferry.slo.forecast import ForecastConfig, HoltWinters, TrafficForecaster, combine
from ferry.slo.smoothing import CapSmoother
from ferry.slo.step_model import StepRecord, StepTimeModel
from ferry.slo.targets import Admission, ControllerLimits, Plan, SloTargets, TokenMix

__all__ = [
    "Admission",
    "CapSmoother",
    "ControllerLimits",
    "ForecastConfig",
    "HoltWinters",
    "Plan",
    "QueuedPrompt",
    "RunningDecode",
    "SloController",
    "SloTargets",
    "StepRecord",
    "StepTimeModel",
    "TokenMix",
    "TrafficForecaster",
    "combine",
    "on_time_order",
    "tpot_slack_ms",
]

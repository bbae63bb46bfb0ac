"""Arrival-rate and token-mix forecast: EWMA for now, Holt-Winters for the day-night shape.

Arrivals are counted in fixed intervals (`interval_s`); each closed interval's rate updates an
EWMA (the short-term rate) and an additive Holt-Winters model (level, trend, one season of
`season_intervals`: a day in production, minutes in a compressed benchmark). Until one whole
season has been seen the forecast is the EWMA plus Holt's trend; after that it is level + trend +
the season's value at each future interval. `forecast()` reports the PEAK over the horizon: it
sizes batch caps and replicas, which must hold for the whole horizon, not its average. The token
mix (prompt and output tokens per request) is an EWMA over requests. Pure Python, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ferry.protocol import TrafficForecast


@dataclass(slots=True)
class ForecastConfig:
    interval_s: float = 60.0
    """Arrivals are counted per interval of this length."""
    season_intervals: int = 1440
    """Intervals in one season (1440 minutes = a day)."""
    horizon_intervals: int = 5
    """How far ahead the forecast looks (it reports the peak over this horizon)."""
    alpha: float = 0.3
    """Level smoothing (also the short-term EWMA's)."""
    beta: float = 0.05
    """Trend smoothing."""
    gamma: float = 0.3
    """Season smoothing."""
    mix_alpha: float = 0.05
    """Token-mix EWMA weight per request."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"ForecastConfig.interval_s={self.interval_s}: must be > 0")
        for name in ("season_intervals", "horizon_intervals"):
            if getattr(self, name) < 1:
                raise ValueError(f"ForecastConfig.{name}={getattr(self, name)}: must be >= 1")
        for name in ("alpha", "beta", "gamma", "mix_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"ForecastConfig.{name}={getattr(self, name)}: must be in (0, 1]")


class HoltWinters:
    """Additive Holt-Winters on a series of equally spaced values."""

    def __init__(self, season: int, alpha: float, beta: float, gamma: float) -> None:
        self.season, self.alpha, self.beta, self.gamma = season, alpha, beta, gamma
        self.level = self.trend = 0.0
        self.seasonal = [0.0] * season
        self.num_seen = 0
        self._first: list[float] = []

    @property
    def is_seasonal(self) -> bool:
        """One whole season seen: the seasonal terms mean something."""
        return self.num_seen >= self.season

    def update(self, value: float) -> None:
        if self.num_seen < self.season:
            self._warm(value)
        else:
            s = self.num_seen % self.season
            prev_level = self.level
            self.level = self.alpha * (value - self.seasonal[s]) + (1 - self.alpha) * (self.level + self.trend)
            self.trend = self.beta * (self.level - prev_level) + (1 - self.beta) * self.trend
            self.seasonal[s] = self.gamma * (value - self.level) + (1 - self.gamma) * self.seasonal[s]
        self.num_seen += 1

    def _warm(self, value: float) -> None:
        """First season: Holt's linear smoothing; at its end the season starts as the deviations
        of that first season from its mean, with no trend (a half-season slope is not one)."""
        if not self._first:
            self.level = value
        else:
            prev_level = self.level
            self.level = self.alpha * value + (1 - self.alpha) * (self.level + self.trend)
            self.trend = self.beta * (self.level - prev_level) + (1 - self.beta) * self.trend
        self._first.append(value)
        if len(self._first) == self.season:
            mean = sum(self._first) / self.season
            self.seasonal = [v - mean for v in self._first]
            self.level, self.trend, self._first = mean, 0.0, []

    def forecast(self, steps_ahead: int) -> float:
        """The value `steps_ahead` (>= 1) intervals after the last one seen."""
        if self.num_seen == 0:
            return 0.0
        season = self.seasonal[(self.num_seen - 1 + steps_ahead) % self.season] if self.is_seasonal else 0.0
        return self.level + steps_ahead * self.trend + season


class TrafficForecaster:
    """Counts arrivals (observe) and forecasts them (forecast); times are seconds on any clock."""

    def __init__(self, config: ForecastConfig | None = None, source: str = "local") -> None:
        self.config = config = config or ForecastConfig()
        self.source = source
        self.model = HoltWinters(config.season_intervals, config.alpha, config.beta, config.gamma)
        self.rate_rps = 0.0
        self.mean_prompt_tokens = self.mean_output_tokens = 0.0
        self.num_requests = 0
        self._interval_start: float | None = None
        self._count = 0

    def observe(self, now_s: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """One request arrived at now_s with this many prompt tokens and (at most) output tokens."""
        self.advance(now_s)
        self._count += 1
        a = self.config.mix_alpha if self.num_requests else 1.0
        self.mean_prompt_tokens += a * (num_prompt_tokens - self.mean_prompt_tokens)
        self.mean_output_tokens += a * (num_output_tokens - self.mean_output_tokens)
        self.num_requests += 1

    def advance(self, now_s: float) -> None:
        """Close every interval that ended by now_s (intervals without arrivals count as 0)."""
        if self._interval_start is None:
            self._interval_start = now_s
            return
        interval = self.config.interval_s
        num_closed = int((now_s - self._interval_start) // interval)
        for _ in range(min(num_closed, 2 * self.config.season_intervals)):  # a long gap: the rest are zeros too
            self._close(self._count / interval)
            self._count = 0
        if num_closed > 0:
            self._interval_start += num_closed * interval

    def _close(self, rate_rps: float) -> None:
        first = self.model.num_seen == 0
        self.rate_rps = rate_rps if first else self.rate_rps + self.config.alpha * (rate_rps - self.rate_rps)
        self.model.update(rate_rps)

    def peak_rps(self) -> float:
        """The highest rate forecast over the horizon (>= 0); the EWMA before a season is seen."""
        horizon = range(1, self.config.horizon_intervals + 1)
        if not self.model.is_seasonal:
            trend = self.model.trend * self.config.horizon_intervals
            return max(0.0, self.rate_rps, self.rate_rps + trend)
        return max(0.0, max(self.model.forecast(h) for h in horizon))

    def forecast(self, now_s: float) -> TrafficForecast:
        self.advance(now_s)
        cfg = self.config
        return TrafficForecast(
            source=self.source,
            timestamp=now_s,
            interval_s=cfg.interval_s,
            rate_rps=self.rate_rps,
            forecast_rps=self.peak_rps(),
            horizon_s=cfg.interval_s * cfg.horizon_intervals,
            mean_prompt_tokens=self.mean_prompt_tokens,
            mean_output_tokens=self.mean_output_tokens,
            num_requests=self.num_requests,
            is_seasonal=self.model.is_seasonal,
        )


def combine(forecasts: list[TrafficForecast]) -> TrafficForecast | None:
    """Several sources (gateway replicas) into one: rates add, token mixes weight by rate."""
    if not forecasts:
        return None
    total = sum(f.forecast_rps for f in forecasts)
    weights = [f.forecast_rps / total if total > 0 else 1 / len(forecasts) for f in forecasts]
    latest = max(forecasts, key=lambda f: f.timestamp)
    return TrafficForecast(
        source="combined",
        timestamp=latest.timestamp,
        interval_s=latest.interval_s,
        rate_rps=sum(f.rate_rps for f in forecasts),
        forecast_rps=total,
        horizon_s=min(f.horizon_s for f in forecasts),
        mean_prompt_tokens=math.fsum(w * f.mean_prompt_tokens for w, f in zip(weights, forecasts)),
        mean_output_tokens=math.fsum(w * f.mean_output_tokens for w, f in zip(weights, forecasts)),
        num_requests=sum(f.num_requests for f in forecasts),
        is_seasonal=all(f.is_seasonal for f in forecasts),
    )

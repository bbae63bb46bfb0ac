"""Traffic forecast: EWMA now, Holt-Winters once a day-night season is seen, token mix, combine."""

import math
import random

import pytest

from ferry.protocol import TrafficForecast, decode, encode
from ferry.slo import ForecastConfig, HoltWinters, TrafficForecaster, combine

pytestmark = pytest.mark.unit


def day_night(t_interval, season=24, base=2.0, amplitude=1.5):
    return base + amplitude * math.sin(2 * math.pi * t_interval / season)


def feed_poisson(fc, rate_fn, num_intervals, interval_s, rng):
    """Arrivals with a time-varying rate, interval by interval."""
    for k in range(num_intervals):
        t = k * interval_s
        count = sum(1 for _ in range(int(rate_fn(k) * interval_s * 4)) if rng.random() < 0.25)
        for i in range(count):
            fc.observe(t + interval_s * (i + 0.5) / max(count, 1), 100, 50)
    fc.advance(num_intervals * interval_s)


def test_holt_winters_learns_a_season_and_forecasts_its_peak():
    hw = HoltWinters(season=24, alpha=0.3, beta=0.01, gamma=0.3)
    for t in range(24 * 4):
        hw.update(day_night(t))
    for h in (1, 6, 12, 18):
        assert hw.forecast(h) == pytest.approx(day_night(24 * 4 - 1 + h), abs=0.15)


def test_before_a_season_the_forecast_is_the_recent_rate():
    fc = TrafficForecaster(ForecastConfig(interval_s=1.0, season_intervals=100), source="gw")
    feed_poisson(fc, lambda k: 3.0, 30, 1.0, random.Random(0))
    out = fc.forecast(30.0)
    assert not out.is_seasonal
    assert out.rate_rps == pytest.approx(3.0, rel=0.35)
    assert out.forecast_rps >= out.rate_rps * 0.9


def test_after_a_season_the_forecast_sees_the_morning_coming():
    """At night (the trough) the seasonal forecast already shows the coming morning; the EWMA cannot."""
    cfg = ForecastConfig(interval_s=1.0, season_intervals=24, horizon_intervals=8, beta=0.01)
    fc = TrafficForecaster(cfg)
    rate = lambda k: day_night(k, amplitude=1.8) * 50  # noqa: E731  10 req/s at night, 190 at noon
    feed_poisson(fc, rate, 24 * 4 + 19, 1.0, random.Random(1))  # 4 days and the darkest hour
    out = fc.forecast(24 * 4 + 19)
    assert out.is_seasonal
    last = fc.model.num_seen - 1
    coming_peak = max(rate(last + h) for h in range(1, 9))
    assert out.forecast_rps == pytest.approx(coming_peak, rel=0.25)
    assert out.forecast_rps > 2 * out.rate_rps


def test_empty_intervals_count_as_zero_and_token_mix_is_tracked():
    fc = TrafficForecaster(ForecastConfig(interval_s=1.0, season_intervals=10, alpha=1.0))
    fc.observe(0.0, 200, 40)
    fc.observe(0.5, 200, 40)
    fc.advance(1.0)
    assert fc.rate_rps == pytest.approx(2.0)
    fc.advance(5.0)
    assert fc.rate_rps == 0.0 and fc.model.num_seen == 5
    assert fc.mean_prompt_tokens == 200 and fc.mean_output_tokens == 40


def test_forecast_is_a_valid_message_and_sources_combine():
    a = TrafficForecaster(ForecastConfig(interval_s=1.0), source="gateway-a")
    b = TrafficForecaster(ForecastConfig(interval_s=1.0), source="gateway-b")
    for i in range(10):
        a.observe(i * 0.5, 100, 10)
        b.observe(i * 0.25, 300, 30)
    fa, fb = a.forecast(5.0), b.forecast(5.0)
    assert decode(encode(fa)) == fa
    both = combine([fa, fb])
    assert both.forecast_rps == pytest.approx(fa.forecast_rps + fb.forecast_rps)
    assert 100 < both.mean_prompt_tokens < 300
    assert combine([]) is None


def test_bad_config_and_messages_name_the_field():
    with pytest.raises(ValueError, match="season_intervals"):
        ForecastConfig(season_intervals=0)
    with pytest.raises(ValueError, match="forecast_rps"):
        TrafficForecast("gw", 0.0, 1.0, 0.0, -1.0, 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="source"):
        TrafficForecast("a.b", 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0)

"""Balancers' arrival forecasts, and which forecasts a worker combines."""

import asyncio

import pytest

from ferry.balancing.arrivals import ArrivalForecast
from ferry.protocol import TrafficForecast, decode
from ferry.slo import ForecastConfig
from ferry_services.worker.slo import pick_forecasts

pytestmark = pytest.mark.unit


class RecordingNats:
    def __init__(self):
        self.sent = []

    async def publish(self, subject, payload):
        self.sent.append((subject, payload))


def test_a_balancer_publishes_what_it_placed_under_its_own_name():
    arrivals = ArrivalForecast("prefill-balancer", ForecastConfig(interval_s=1.0, season_intervals=4))
    for i in range(6):
        arrivals.observe(100 + 20 * (i % 2), 32, now_s=10.0 + i * 0.5)  # 2 per second
    nc = RecordingNats()
    asyncio.run(arrivals.publish(nc, "abc", now_s=13.0))
    ((subject, payload),) = nc.sent
    forecast = decode(payload, TrafficForecast)
    assert subject == "ferry.forecast.prefill-balancer-abc" and forecast.source == "prefill-balancer-abc"
    assert forecast.num_requests == 6 and forecast.rate_rps == pytest.approx(2.0)
    assert 100 <= forecast.mean_prompt_tokens <= 120 and forecast.mean_output_tokens == pytest.approx(32.0)


def fc(source, rps):
    return TrafficForecast(source, 0.0, 60.0, rps, rps, 300.0, 100.0, 50.0, 10, False)


def test_a_worker_takes_its_roles_balancers_else_the_gateways_never_both():
    every = [fc("gateway-a", 4.0), fc("gateway-b", 1.0), fc("prefill-balancer-x", 3.0), fc("decode-balancer-y", 2.0)]
    assert [f.source for f in pick_forecasts(every, "prefill")] == ["prefill-balancer-x"]
    assert [f.source for f in pick_forecasts(every, "decode")] == ["decode-balancer-y"]
    assert [f.source for f in pick_forecasts(every, "both")] == ["gateway-a", "gateway-b"]
    assert [f.source for f in pick_forecasts(every[2:], "both")] == ["prefill-balancer-x", "decode-balancer-y"]
    assert pick_forecasts([], "decode") == []

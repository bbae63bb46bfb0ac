"""SLO-driven batching over real NATS: a decode worker with FERRY_TPOT_SLO_MS learns its step time,
sizes its cap from the published traffic forecast, shows it in micro stats and load reports (the
balancers route with the cap in view) and says how many replicas the forecast needs; a fixed
FERRY_MAX_NUM_SEQS worker keeps its cap; the gateway publishes its measured arrivals."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_worker_micro_stats import work_endpoint
from test_worker_pipeline import GREEDY, PROMPTS, Client, System

from ferry.protocol import GenerateRequest, LoadReport, SamplingParams, TrafficForecast, decode, encode, subjects
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.traffic import GatewayTraffic

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", "tiny")


def forecast(rps: float) -> TrafficForecast:
    return TrafficForecast(
        source="gateway-test",
        timestamp=time.time(),
        interval_s=60.0,
        rate_rps=rps,
        forecast_rps=rps,
        horizon_s=300.0,
        mean_prompt_tokens=40.0,
        mean_output_tokens=12.0,
        num_requests=100,
    )


async def next_load_report(nc, role: str, worker_id: str) -> LoadReport:
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_report(msg) -> None:
        if not got.done():
            got.set_result(decode(msg.data, LoadReport))

    sub = await nc.subscribe(subjects.load(role, worker_id), cb=on_report)
    try:
        return await asyncio.wait_for(got, 5)
    finally:
        await sub.unsubscribe()


async def run_prompts(nc, prefix: str) -> None:
    client = Client(nc)
    await client.start()
    ids = [f"{prefix}{i}" for i in range(len(PROMPTS))]
    replies = [await client.submit(rid, p, GREEDY) for rid, p in zip(ids, PROMPTS)]
    assert all(r.accepted for r in replies), replies
    await client.wait_finished(ids)
    assert client.errors == []


async def test_an_adaptive_decode_worker_learns_sizes_and_reports_its_cap(nc, nats_url, redis_url, redis, tiny_model):
    system = System(nats_url, redis_url, tiny_model, tpot_slo_ms=2000.0, ttft_slo_ms=10_000.0)
    await system.start()
    try:
        await asyncio.sleep(0.5)  # first load reports reach the balancers
        await nc.publish(subjects.forecast("gateway-test"), encode(forecast(1e6)))
        await nc.flush()
        await run_prompts(nc, "a")
        worker = system.workers["decode-t"]
        slo = (await work_endpoint(nc, worker))["data"]["slo"]
        assert slo["adaptive"] and slo["step_model"]["num_observations"] > 0
        assert slo["forecast_rps"] == pytest.approx(1e6)  # from the published forecast, not local arrivals
        assert slo["desired_replicas"] > 1  # a million req/s is more than one tiny worker serves
        assert 4 <= slo["max_num_seqs"] <= 8 and slo["max_num_seqs"] == worker.engine.max_num_seqs
        report = await next_load_report(nc, "decode", "decode-t")
        assert report.max_running == worker.engine.max_num_seqs  # the cap the decode-balancer routes with
    finally:
        await system.stop()


async def test_a_fixed_cap_worker_keeps_its_cap(nc, nats_url, redis_url, redis, tiny_model):
    system = System(nats_url, redis_url, tiny_model, tpot_slo_ms=5.0, max_num_seqs=3)
    await system.start()
    try:
        await asyncio.sleep(0.5)
        await run_prompts(nc, "f")
        worker = system.workers["decode-t"]
        slo = (await work_endpoint(nc, worker))["data"]["slo"]
        assert slo == {"adaptive": False, "max_num_seqs": 3}
        assert (await next_load_report(nc, "decode", "decode-t")).max_running == 3
    finally:
        await system.stop()


async def test_the_gateway_publishes_the_arrivals_it_measured(nc, nats_url):
    got: asyncio.Queue = asyncio.Queue()

    async def on_forecast(msg) -> None:
        await got.put(decode(msg.data, TrafficForecast))

    await nc.subscribe(subjects.FORECAST_ALL, cb=on_forecast)
    await nc.flush()
    bus = GatewayBus("gw1", traffic=GatewayTraffic("gw1", publish_s=0.1))
    await bus.start(nats_url)
    try:
        for i in range(5):
            bus.traffic.on_accepted(
                GenerateRequest(f"r{i}", "gw1", "tiny", list(range(3, 3 + 20)), SamplingParams(max_tokens=30))
            )
        message = await asyncio.wait_for(got.get(), 5)
    finally:
        await bus.stop()
    assert message.source == "gateway-gw1"
    assert message.num_requests == 5
    assert (message.mean_prompt_tokens, message.mean_output_tokens) == (20.0, 30.0)

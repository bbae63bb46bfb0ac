"""The gateway's SLO outcome of a finished request and its arrival counting."""

import pytest

from ferry.protocol import GenerateRequest, SamplingParams
from ferry_services.gateway.traffic import GatewayTraffic, slo_outcome

pytestmark = pytest.mark.unit


def test_outcomes_name_which_target_was_missed():
    assert slo_outcome(0.5, 0.02, ttft_slo_ms=1000, tpot_slo_ms=50) == "met"
    assert slo_outcome(1.5, 0.02, ttft_slo_ms=1000, tpot_slo_ms=50) == "ttft_missed"
    assert slo_outcome(0.5, 0.08, ttft_slo_ms=1000, tpot_slo_ms=50) == "tpot_missed"
    assert slo_outcome(1.5, 0.08, ttft_slo_ms=1000, tpot_slo_ms=50) == "both_missed"
    assert slo_outcome(0.5, None, ttft_slo_ms=1000, tpot_slo_ms=50) == "met"  # one token: no gap to miss


def test_accepted_requests_are_the_forecasters_arrivals():
    traffic = GatewayTraffic("g1")
    for i in range(3):
        request = GenerateRequest(f"r{i}", "g1", "m", [1] * 10, SamplingParams(max_tokens=7), output_token_ids=[2, 3])
        traffic.on_accepted(request)
    fc = traffic.forecaster
    assert (fc.num_requests, fc.mean_prompt_tokens, fc.mean_output_tokens) == (3, 12.0, 7.0)
    assert traffic.source == "gateway-g1"

"""ferry.metrics: every documented metric is served on /metrics with the names the dashboard uses."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ferry import metrics

pytestmark = pytest.mark.unit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def served():
    port = _free_port()
    server = metrics.start_metrics_server(port, addr="127.0.0.1")
    yield port
    server.shutdown()
    server.server_close()


def test_every_documented_name_is_defined():
    documented = {line.split("|")[1].strip() for line in metrics.__doc__.splitlines() if line.startswith("| ferry_")}
    exposed = set()
    for m in metrics.ALL_METRICS:
        name = m.describe()[0].name
        exposed.add(name + "_total" if m._type == "counter" else name)
    assert documented == exposed


def test_served_values_follow_updates(served):
    metrics.REQUESTS_RUNNING.labels(role="decode").set(7)
    metrics.TIME_TO_FIRST_TOKEN.observe(0.3)
    metrics.GENERATION_TOKENS.inc(5)
    metrics.WORKER_QUEUE_DEPTH.labels(role="prefill", worker="w-1").set(3)
    metrics.ERRORS.labels(service="worker", kind="ProtocolError").inc()
    families = _scrape(served)
    running = [s for s in families["ferry_requests_running"].samples if s.labels == {"role": "decode"}]
    assert running[0].value == 7
    ttft_count = [s for s in families["ferry_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0].value >= 1
    gen = [s for s in families["ferry_generation_tokens"].samples if s.name == "ferry_generation_tokens_total"]
    assert gen[0].value >= 5
    depth = families["ferry_worker_queue_depth"].samples
    assert any(s.labels == {"role": "prefill", "worker": "w-1"} and s.value == 3 for s in depth)
    assert set(metrics.metric_names()) <= set(families)


def test_port_zero_means_off_and_bad_port_is_refused():
    assert metrics.start_metrics_server(0) is None
    with pytest.raises(ValueError, match="metrics port"):
        metrics.start_metrics_server(70000)

"""ops/prometheus + ops/grafana: Prometheus finds every (scaled) ferry service, and the dashboard
plots only metrics that ferry.metrics defines, all of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml

from ferry import metrics

pytestmark = pytest.mark.ops

ROOT = Path(__file__).resolve().parents[2]
FERRY_SERVICES = {"gateway", "prefill-balancer", "decode-balancer", "prefill-worker", "decode-worker", "kvcache"}
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _exposed_names() -> set[str]:
    return set(metrics.metric_names())


def _base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in _exposed_names():
            return name[: -len(suffix)]
    return name


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((ROOT / "ops/grafana/dashboards/ferry.json").read_text())


def test_prometheus_discovers_every_service_by_dns():
    config = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    ferry_job = next(job for job in config["scrape_configs"] if job["job_name"] == "ferry")
    names, ports = set(), set()
    for sd in ferry_job["dns_sd_configs"]:
        assert sd["type"] == "A"  # one record per replica: --scale adds targets
        names |= set(sd["names"])
        ports.add(sd["port"])
    assert names == FERRY_SERVICES
    assert names <= set(compose["services"])
    served = {compose["services"][n]["environment"]["FERRY_METRICS_PORT"] for n in FERRY_SERVICES}
    assert {str(p) for p in ports} == served


def test_dashboard_plots_every_metric_and_only_real_ones(dashboard):
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {_base(n) for e in exprs for n in re.findall(r"\bferry_[a-z0-9_]+", e)}
    assert used == _exposed_names()


def test_dashboard_uses_the_provisioned_datasource(dashboard):
    provisioned = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid
        assert all(t["datasource"]["uid"] == uid for t in panel["targets"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_expressions_have_balanced_brackets(dashboard):
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for open_, close in ("()", "[]", "{}"):
                assert expr.count(open_) == expr.count(close), expr


ALERTS = ROOT / "ops/prometheus/alerts.yml"


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def _metric_names(expr: str) -> set[str]:
    """Every series name the expression selects, from promql-parser's AST (a syntax error raises)."""
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_alert_rules_parse_and_name_only_real_metrics():
    rules = _rules()
    recorded = {r["record"] for r in rules if "record" in r}
    for rule in rules:
        for name in _metric_names(rule["expr"]):
            known = _base(name) in _exposed_names() or name in recorded or name == "up"
            assert known, f"{rule.get('alert') or rule.get('record')}: {name} is not a ferry metric"


def test_the_alerts_an_sre_needs_exist_with_severity_and_a_summary():
    alerts = {r["alert"]: r for r in _rules() if "alert" in r}
    covered = {
        "ttft": "ferry_time_to_first_token_seconds",
        "tpot": "ferry_inter_token_latency_seconds",
        "errors": "ferry_requests",
        "queue lag": "ferry_worker_queue_depth",
        "worker down": "up",
        "kv store near full": "ferry_kv_store_used_bytes",
    }
    rules = _rules()
    exprs = " ".join(r["expr"] for r in rules)
    for what, metric in covered.items():
        assert metric in exprs, what
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in ("page", "ticket"), name
        assert alert["annotations"]["summary"] and "for" in alert, name
    config = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert "./ops/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]


def test_the_rule_checks_can_fail():
    with pytest.raises(ValueError):
        _metric_names("sum(rate(ferry_requests_total[5m])")  # unbalanced
    assert _metric_names("rate(ferry_no_such_metric_total[5m]) > 1") == {"ferry_no_such_metric_total"}
    assert _base("ferry_no_such_metric_total") not in _exposed_names()

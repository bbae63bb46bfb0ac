"""ferry.settings: FERRY_* environment variables, defaults, and errors that name the variable."""

from __future__ import annotations

import pytest
from pydantic import Field

from ferry.protocol import subjects
from ferry.settings import ServiceSettings, SettingsError, default_instance_id, load_settings

pytestmark = pytest.mark.unit


class WorkerLikeSettings(ServiceSettings):
    max_running: int = Field(default=64, ge=1)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("NATS_URL", "REDIS_URL", "LOG_LEVEL", "LOG_JSON", "METRICS_PORT", "MAX_RUNNING"):
        monkeypatch.delenv(f"FERRY_{var}", raising=False)


def test_defaults_point_at_local_servers():
    s = load_settings(ServiceSettings)
    assert (s.nats_url, s.redis_url) == ("nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0")
    assert (s.log_level, s.log_json, s.metrics_port) == ("INFO", False, 0)


def test_values_come_from_ferry_variables(monkeypatch):
    monkeypatch.setenv("FERRY_NATS_URL", "nats://a:4222,nats://b:4222")
    monkeypatch.setenv("FERRY_LOG_JSON", "true")
    monkeypatch.setenv("FERRY_METRICS_PORT", "9100")
    monkeypatch.setenv("FERRY_MAX_RUNNING", "8")
    monkeypatch.setenv("NATS_URL", "nats://unprefixed:1")  # only FERRY_* counts
    s = load_settings(WorkerLikeSettings)
    assert s.nats_url == "nats://a:4222,nats://b:4222"
    assert (s.log_json, s.metrics_port, s.max_running) == (True, 9100, 8)


def test_explicit_overrides_beat_the_environment(monkeypatch):
    monkeypatch.setenv("FERRY_LOG_LEVEL", "DEBUG")
    assert load_settings(ServiceSettings, log_level="ERROR").log_level == "ERROR"


@pytest.mark.parametrize(
    "var, value",
    [
        ("FERRY_METRICS_PORT", "lots"),
        ("FERRY_METRICS_PORT", "70000"),
        ("FERRY_LOG_LEVEL", "LOUD"),
        ("FERRY_LOG_JSON", "maybe"),
        ("FERRY_MAX_RUNNING", "0"),
    ],
)
def test_invalid_value_exits_naming_the_variable_and_value(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as err:
        load_settings(WorkerLikeSettings)
    assert f"invalid {var}={value!r}" in str(err.value)


def test_every_invalid_variable_is_named_at_once(monkeypatch):
    monkeypatch.setenv("FERRY_METRICS_PORT", "-1")
    monkeypatch.setenv("FERRY_MAX_RUNNING", "many")
    with pytest.raises(SettingsError) as err:
        load_settings(WorkerLikeSettings)
    assert "FERRY_METRICS_PORT" in str(err.value) and "FERRY_MAX_RUNNING" in str(err.value)


def test_default_instance_ids_are_unique_subject_tokens():
    ids = {default_instance_id() for _ in range(50)}
    assert len(ids) == 50
    for worker_id in ids:
        subjects.work("prefill", worker_id)  # raises if not a valid subject token

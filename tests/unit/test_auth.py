"""API keys and body-size limits of the gateway, through its real app (no bus: an admitted request
ends in 503 bus_unavailable, which proves it got past the guard)."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from ferry.model.make_model import make_model
from ferry_services.gateway.app import create_app
from ferry_services.gateway.auth import ApiKeys, exposure_problem
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.service import model_limits
from ferry_services.gateway.settings import GatewaySettings
from ferry_services.gateway.tokenizer import load_model_info

pytestmark = pytest.mark.unit

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-from-file"
LIMIT = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny-auth"), "llama", "tiny")


def make_client(model_dir, **settings_fields) -> TestClient:
    settings = GatewaySettings(model=str(model_dir), gateway_id="gw-auth", **settings_fields)
    info = load_model_info(settings.model)
    app = create_app(settings, info.tokenizer, model_limits(settings, info), GatewayBus("gw-auth"))
    return TestClient(app)


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# rotated 2026-12\n\n{KEY_B}\n")
    with make_client(model_dir, api_keys=f" {KEY_A} ,", api_key_file=str(key_file), max_body_bytes=LIMIT) as client:
        yield client


def body() -> dict:
    return {"model": "tiny-auth0", "prompt": "hello", "max_tokens": 2}


def test_valid_keys_from_env_and_file_pass_the_guard(guarded):
    for key in (KEY_A, KEY_B):
        response = guarded.post("/v1/completions", json=body(), headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "bus_unavailable"
    assert guarded.get("/v1/models", headers={"Authorization": f"bearer {KEY_A}"}).status_code == 200


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        f"Basic {KEY_A}",
        f"Bearer {KEY_A}x",
        f"Bearer {KEY_A[:-1]}",
        "Bearer # rotated 2026-12",
        f"{KEY_A}",
    ],
)
def test_missing_or_wrong_key_is_401_openai_shaped_and_leaks_nothing(guarded, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for response in (
        guarded.post("/v1/completions", json=body(), headers=headers),
        guarded.get("/v1/models", headers=headers),
        guarded.post("/v1/chat/completions", content=b"\xff not json", headers=headers),
    ):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert KEY_A not in response.text and KEY_B not in response.text


def test_probes_stay_open(guarded):
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/ready").status_code == 503  # open, just not ready without a bus


def test_body_over_the_limit_is_413_declared_or_chunked(guarded):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    big = {"model": "tiny-auth0", "prompt": "x" * (LIMIT + 1)}
    response = guarded.post("/v1/completions", json=big, headers=auth)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(LIMIT // 256 + 2):
            yield b" " * 256

    response = guarded.post("/v1/completions", content=chunks(), headers=auth)
    assert response.status_code == 413
    # just under the limit is parsed normally (and fails later, for lack of workers)
    padded = b'{"model": "tiny-auth0", "prompt": "hi"' + b" " * (LIMIT - 100) + b"}"
    response = guarded.post("/v1/completions", content=padded, headers={**auth, "Content-Type": "application/json"})
    assert response.status_code == 503, response.text


def test_no_key_configured_is_open_and_says_so(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ferry.gateway"):
        with make_client(model_dir, api_keys="", api_key_file="") as client:
            assert client.post("/v1/completions", json=body()).status_code == 503
    assert any("OPEN" in r.getMessage() for r in caplog.records)


def test_configured_keys_never_appear_in_logs(model_dir, caplog):
    with caplog.at_level(logging.DEBUG):
        with make_client(model_dir, api_keys=KEY_A) as client:
            client.post("/v1/completions", json=body(), headers={"Authorization": "Bearer wrong"})
            client.post("/v1/completions", json=body(), headers={"Authorization": f"Bearer {KEY_A}"})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "1 key(s) configured" in text and KEY_A not in text


def test_settings_repr_hides_the_keys(model_dir):
    settings = GatewaySettings(model=str(model_dir), api_keys=KEY_A)
    assert KEY_A not in repr(settings) and KEY_A not in str(settings)


def test_key_file_errors_name_the_file_not_its_content(tmp_path):
    with pytest.raises(ValueError, match="api_key_file"):
        ApiKeys.from_settings("", str(tmp_path / "absent.txt"))
    keys = ApiKeys.from_settings("a,b,a", "")
    assert len(keys) == 2 and keys.allows("Bearer b") and not keys.allows("Bearer c")
    assert ApiKeys([]).allows(None) and not ApiKeys([]).enabled


@pytest.mark.parametrize(
    ("host", "keys", "allow_open", "refused"),
    [
        ("0.0.0.0", [], False, True),  # the old default in compose and k8s: open to the network
        ("::", [], False, True),
        ("10.1.2.3", [], False, True),
        ("gateway.internal", [], False, True),
        ("0.0.0.0", ["k1"], False, False),
        ("0.0.0.0", [], True, False),  # FERRY_ALLOW_OPEN=1: on purpose
        ("127.0.0.1", [], False, False),
        ("127.0.0.2", [], False, False),
        ("::1", [], False, False),
        ("localhost", [], False, False),
    ],
)
def test_an_open_gateway_on_a_reachable_address_is_refused(host, keys, allow_open, refused):
    problem = exposure_problem(host, ApiKeys(keys), allow_open)
    assert bool(problem) == refused
    if refused:
        assert f"FERRY_HTTP_HOST={host}" in problem and "FERRY_API_KEYS" in problem and "FERRY_ALLOW_OPEN=1" in problem


def test_the_gateway_process_stops_at_start_with_the_reason(model_dir):
    """No key, listening on every interface: one line naming the fix, exit status 1, no traceback."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(FERRY_MODEL=str(model_dir), FERRY_HTTP_HOST="0.0.0.0", FERRY_NATS_URL="nats://127.0.0.1:1")
    result = subprocess.run(
        [sys.executable, "-m", "ferry_services.gateway"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "FERRY_HTTP_HOST=0.0.0.0 is reachable from other machines and no API key is set" in result.stderr
    assert "Traceback" not in result.stderr

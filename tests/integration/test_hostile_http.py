"""Hostile HTTP bodies against the gateway's real app (guard, schemas, conversion, tokenizer), with
no bus behind it: whatever arrives, the answer is a clear OpenAI-shaped 4xx (or 503: the body was
fine but there is no bus), never a 500 and never a crash. Property tests (hypothesis) plus
schemathesis over the app's own OpenAPI document; both bounded to run in well under a minute."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ferry.model.make_model import make_model
from ferry_services.gateway.app import create_app
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.service import model_limits
from ferry_services.gateway.settings import GatewaySettings
from ferry_services.gateway.tokenizer import load_model_info

pytestmark = pytest.mark.integration

MODEL = "tiny-hostile0"
LIMIT = 64 * 1024
CLEAR = {400, 401, 404, 405, 413, 503}
"""Every status a hostile body may get: the client's fault, or 'no bus here' for a fine body."""
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "echo",
    "user",
    "logit_bias",
    "response_format",
    "tools",
    "suffix",
    "best_of",
    "min_p",
    "stop_token_ids",
    "add_generation_prompt",
]
PROFILE = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp("hostile") / MODEL, "llama", "tiny")
    gw_settings = GatewaySettings(model=str(model_dir), gateway_id="gw-hostile", max_body_bytes=LIMIT)
    info = load_model_info(gw_settings.model)
    return create_app(gw_settings, info.tokenizer, model_limits(gw_settings, info), GatewayBus("gw-hostile"))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def assert_clear(response) -> None:
    assert response.status_code in CLEAR, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
wrongly_typed = st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=8)


@PROFILE
@given(body=wrongly_typed, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_known_fields_with_any_types_get_a_clear_error(client, body, path):
    body.setdefault("model", MODEL)
    assert_clear(client.post(path, json=body))


@PROFILE
@given(body=json_value, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_json_document_gets_a_clear_error(client, body, path):
    assert_clear(client.post(path, json=body))


@PROFILE
@given(raw=st.binary(max_size=300))
def test_arbitrary_bytes_get_a_clear_error(client, raw):
    assert_clear(client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}))


@PROFILE
@given(
    text=st.text(st.characters(codec=None, exclude_categories=()), max_size=60),
    surrogate=st.integers(min_value=0xD800, max_value=0xDFFF),
)
@example(text='\ud800"', surrogate=0xDC00)  # a lone surrogate and a quote in the text itself (CI found the first)
def test_any_unicode_and_lone_surrogates_in_every_text_field(client, text, surrogate):
    # text JSON-escaped (it may hold quotes, control characters or lone surrogates of its own), then one
    # more lone surrogate as an escape: JSON can carry it; no tokenizer or msgpack can
    lone = f"{json.dumps(text)[1:-1]}\\u{surrogate:04x}"
    for body in (
        f'{{"model": "{MODEL}", "prompt": "{lone}"}}',
        f'{{"model": "{MODEL}", "prompt": "hi", "stop": ["{lone}"]}}',
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{lone}", "name": "{lone}"}}]}}',
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
        assert_clear(response)
    plain = json.dumps({"model": MODEL, "prompt": text, "stop": [text or "x"]})  # \u escapes: valid UTF-8 bytes
    assert_clear(client.post("/v1/completions", content=plain.encode(), headers={"Content-Type": "application/json"}))


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 200_000 + b"]" * 200_000,  # deep JSON (over the size limit too)
        b'{"model": "x", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # deep JSON under the limit
        b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe\xc0"}',  # invalid UTF-8
        b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 1e308}',
        b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 4294967297}',
        b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "temperature": NaN}',
        b'{"model": "' + MODEL.encode() + b'", "prompt": [99999999999999999999999]}',
        b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"word " * 12_000 + b'"}',  # over the context
        b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "n": 1000000, "unknown_field": {"a": [1]}}',
    ],
)
def test_named_hostile_bodies(client, raw):
    assert_clear(client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}))


def test_a_huge_body_is_refused_before_parsing(client):
    response = client.post("/v1/completions", content=b"x" * (LIMIT + 1), headers={"Content-Type": "application/json"})
    assert response.status_code == 413


def test_openapi_document_fuzzed_by_schemathesis(app):
    """Every operation of /openapi.json, with bodies generated from its schema (valid and not)."""
    schemathesis = pytest.importorskip("schemathesis", reason="dev dependency schemathesis not installed")
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    for operation in operations:

        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def call(case) -> None:
            response = case.call()
            assert response.status_code in CLEAR | {200}, (
                case.method,
                case.path,
                response.status_code,
                response.text[:300],
            )
            if response.status_code >= 400 and case.path != "/ready":  # /ready's 503 is its own report
                assert "error" in json.loads(response.text)

        call()

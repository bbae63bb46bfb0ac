"""The gateway's HTTP surface without a bus: validation, OpenAI error shapes, health, models.

Every bad body gets a 400/404 naming the field, before anything reaches NATS; a good body with no
live worker gets a 503 (the bus here is never connected)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ferry.model.make_model import make_model
from ferry_services.gateway.app import create_app
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.service import model_limits
from ferry_services.gateway.settings import GatewaySettings
from ferry_services.gateway.tokenizer import load_model_info

pytestmark = pytest.mark.unit

CONTEXT = 64


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    model_dir = make_model(tmp_path_factory.mktemp("tiny-llama"), "llama", "tiny")
    settings = GatewaySettings(model=str(model_dir), max_context_len=CONTEXT, gateway_id="gw-test")
    info = load_model_info(settings.model)
    app = create_app(settings, info.tokenizer, model_limits(settings, info), GatewayBus("gw-test"))
    with TestClient(app) as client:
        yield client


def chat(**fields) -> dict:
    return {"model": "tiny-llama0", "messages": [{"role": "user", "content": "hello"}], **fields}


def completion(**fields) -> dict:
    return {"model": "tiny-llama0", "prompt": "hello world", **fields}


def assert_error(response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert error["message"]
    return error


def test_health_is_alive_without_a_bus(client):
    assert client.get("/health").json() == {"status": "alive"}


def test_ready_is_503_until_the_bus_is_connected(client):
    response = client.get("/ready")
    assert response.status_code == 503
    assert response.json()["bus_connected"] is False


def test_models_lists_the_served_model_named_after_its_folder(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny-llama0"]
    assert data[0]["max_model_len"] == CONTEXT
    assert client.get("/v1/models/tiny-llama0").status_code == 200
    assert_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat(temperature=3), "temperature"),
        ("/v1/chat/completions", chat(top_p=0), "top_p"),
        ("/v1/chat/completions", chat(max_tokens=0), "max_tokens"),
        ("/v1/chat/completions", chat(n=2), "n"),
        ("/v1/chat/completions", chat(messages=[]), "messages"),
        ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
        ("/v1/chat/completions", chat(stop=["ok", ""]), "stop"),
        ("/v1/chat/completions", chat(stop_token_ids=["eos"]), "stop_token_ids[0]"),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content",
        ),
        ("/v1/chat/completions", chat(top_logprobs=25, logprobs=True), "top_logprobs"),
        ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
        ("/v1/chat/completions", chat(stream="yes please"), "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/v1/completions", completion(logprobs=21), "logprobs"),
        ("/v1/completions", completion(echo=True), "echo"),
        ("/v1/completions", completion(prompt=["a", "b"]), "prompt"),
        ("/v1/completions", completion(prompt=[1, 2, 100000]), "prompt"),
        ("/v1/completions", completion(prompt=[]), "prompt"),
        ("/v1/completions", completion(prompt={"text": "hi"}), "prompt"),
        ("/v1/completions", completion(presence_penalty=-3), "presence_penalty"),
    ],
)
def test_a_bad_field_is_a_400_that_names_it(client, path, body, param):
    assert_error(client.post(path, json=body), 400, param)


def test_a_union_field_error_says_what_each_form_wanted(client):
    body = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    error = assert_error(client.post("/v1/chat/completions", json=body), 400, "messages[0].content")
    assert "valid string" in error["message"] and "[0].type: Input should be 'text'" in error["message"]


def test_a_body_that_is_not_json_or_not_an_object_is_a_400(client):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(response, 400, None)
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, None)


def test_an_unknown_model_is_a_404(client):
    assert_error(client.post("/v1/chat/completions", json=chat(model="gpt-4o")), 404, "model", "model_not_found")


def test_a_prompt_longer_than_the_context_is_rejected(client):
    long_prompt = "hello world " * CONTEXT
    assert_error(
        client.post("/v1/completions", json=completion(prompt=long_prompt)), 400, "prompt", "context_length_exceeded"
    )
    messages = [{"role": "user", "content": long_prompt}]
    assert_error(
        client.post("/v1/chat/completions", json=chat(messages=messages)), 400, "messages", "context_length_exceeded"
    )


def test_max_tokens_beyond_the_context_names_the_field(client):
    assert_error(
        client.post("/v1/completions", json=completion(max_tokens=CONTEXT)),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    assert_error(
        client.post("/v1/chat/completions", json=chat(max_completion_tokens=CONTEXT)),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    )


def test_a_valid_request_without_a_bus_is_a_503(client):
    error = assert_error(client.post("/v1/chat/completions", json=chat()), 503, None, "bus_unavailable")
    assert "message bus" in error["message"]
    assert_error(client.post("/v1/completions", json=completion(stream=True)), 503, None, "bus_unavailable")


class CountingTokenizer:
    """The model's tokenizer, counting the prompts it encodes."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_encodes = 0

    def encode(self, text, add_special_tokens=True):
        self.num_encodes += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.inner.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def test_a_full_gateway_answers_429_without_tokenizing_the_prompt(tmp_path):
    """At its in-flight limit the gateway turns requests away before the tokenizer or the chat
    template runs, so a flood of retries costs it next to nothing."""
    model_dir = make_model(tmp_path / "tiny-llama", "llama", "tiny")
    settings = GatewaySettings(model=str(model_dir), gateway_id="gw-full", max_inflight=1, retry_after_s=2)
    info = load_model_info(settings.model)
    tokenizer = CountingTokenizer(info.tokenizer)
    bus = GatewayBus("gw-full")
    bus.tracker.open("a-request-in-flight")
    with TestClient(create_app(settings, tokenizer, model_limits(settings, info), bus)) as client:
        body = {"model": "tiny-llama", "prompt": "hello world " * 50}
        response = client.post("/v1/completions", json=body)
        assert_error(response, 429, None, "overloaded")
        assert response.headers["retry-after"] == "2"
        assert_error(client.post("/v1/chat/completions", json=chat(model="tiny-llama")), 429, None, "overloaded")
    assert tokenizer.num_encodes == 0

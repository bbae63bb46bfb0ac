"""The gateway's request path against a real nats-server, with the test peer of test_gateway_peer.py
playing balancer + worker: readiness, conversion, streaming, usage, stop, logprobs, status mapping,
timeouts, cancellation on disconnect, admission, and the official `openai` SDK (sync and async,
streamed and not, chat and completions). One gateway process serves the whole module."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from test_gateway_peer import GATEWAY_ID, MAX_INFLIGHT, TIMEOUT_S, Peer, gateway_url, model_dir, peer  # noqa: F401
from waiting import wait_until_sync

from ferry.protocol import GenerateRequest

pytestmark = pytest.mark.integration


def sse_payloads(response: httpx.Response) -> list:
    """The JSON payloads of an SSE body, and the final '[DONE]'."""
    lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def last_submit(peer: Peer, request_id: str) -> GenerateRequest:
    return next(r for r in peer.submits if r.request_id == request_id)


def test_ready_lists_the_live_workers(gateway_url):
    body = httpx.get(f"{gateway_url}/ready").json()
    assert body["bus_connected"] is True
    assert body["workers"] == {"prefill": ["prefill-peer"], "decode": ["decode-peer"]}


def test_completion_converts_sampling_and_counts_usage(gateway_url, peer):
    body = {
        "model": "tiny",
        "prompt": "hello world",
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["zzz"],
    }
    response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    out = response.json()
    sent = last_submit(peer, out["id"])
    assert sent.gateway_id == GATEWAY_ID
    assert (sent.sampling.max_tokens, sent.sampling.temperature, sent.sampling.top_p) == (5, 0.5, 0.9)
    assert (sent.sampling.seed, sent.sampling.stop) == (7, ["zzz"])
    assert sent.prompt_token_ids == peer.tokenizer.encode("hello world")
    expected = peer.tokenizer.decode(peer.reply_ids[:5])
    assert out["choices"][0]["text"] == expected
    assert out["choices"][0]["finish_reason"] == "length"
    n = len(sent.prompt_token_ids)
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 5, "total_tokens": n + 5}


def test_chat_stream_relays_every_token_once_with_usage(gateway_url, peer):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "say hi mode:dup"}],
        "stream": True,
        "max_tokens": 6,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks, usage = payloads[:-2], payloads[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == peer.tokenizer.decode(peer.reply_ids[:6])  # each token sent twice, relayed once
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == len(last_submit(peer, usage["id"]).prompt_token_ids)


def test_a_stop_string_ends_the_answer_before_it(gateway_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": "river"}
    out = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=10).json()
    assert out["choices"][0]["message"]["content"] == "The ferry boat crossed the "
    assert out["choices"][0]["finish_reason"] == "stop"


def test_logprobs_have_openai_shapes(gateway_url, peer):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "logprobs": 1}
    lp = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=10).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [peer.tokenizer.decode([t]) for t in peer.reply_ids[:3]]
    assert lp["token_logprobs"] == [-0.25] * 3
    assert [list(top.values()) for top in lp["top_logprobs"]] == [[-0.25]] * 3
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    content = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=10).json()["choices"][0]["logprobs"][
        "content"
    ]
    assert [c["token"] for c in content] == [peer.tokenizer.decode([t]) for t in peer.reply_ids[:2]]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.25, -1.75]


@pytest.mark.parametrize(
    ("mode", "status", "code"), [("overloaded", 429, "overloaded"), ("noworkers", 503, "no_workers")]
)
def test_balancer_rejections_map_to_http_statuses(gateway_url, mode, status, code):
    body = {"model": "tiny", "prompt": f"mode:{mode}", "stream": True}
    response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=10)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    if status == 429:
        assert response.headers["retry-after"] == "3"


def test_a_worker_error_reaches_the_client(gateway_url):
    body = {"model": "tiny", "prompt": "mode:error"}
    response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "decode worker crashed"
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json={**body, "stream": True}, timeout=10) as r:
        payloads = sse_payloads(r)
    assert payloads[0]["error"]["code"] == "internal" and payloads[-1] == "[DONE]"


def test_a_silent_request_times_out_and_is_cancelled(gateway_url, peer):
    started = time.monotonic()
    response = httpx.post(f"{gateway_url}/v1/completions", json={"model": "tiny", "prompt": "mode:hang"}, timeout=10)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    assert time.monotonic() - started < TIMEOUT_S + 3
    request_id = peer.submits[-1].request_id
    wait_until_sync(lambda: peer.cancel_reason(request_id) == "timeout", "cancelled: timeout", 5)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(gateway_url, peer, stream):
    body = {"model": "tiny", "prompt": "mode:hang", "stream": stream}
    num_submits = len(peer.submits)
    if stream:
        with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, timeout=10) as response:
            assert response.status_code == 200  # headers sent, no token yet: hang up now
    else:
        with pytest.raises(httpx.ReadTimeout):  # gives up waiting and closes the connection
            httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=0.5)
    wait_until_sync(lambda: len(peer.submits) > num_submits, "a submit", 5)
    request_id = peer.submits[-1].request_id
    wait_until_sync(
        lambda: peer.cancel_reason(request_id) == "client_disconnected",
        "cancelled: client_disconnected",
        TIMEOUT_S - 0.5,
    )


def test_admission_is_429_when_max_inflight_requests_wait(gateway_url, peer):
    body = {"model": "tiny", "prompt": "mode:hang", "stream": True}
    with httpx.Client(timeout=10) as client:
        streams = [
            client.send(client.build_request("POST", f"{gateway_url}/v1/completions", json=body), stream=True)
            for _ in range(MAX_INFLIGHT)
        ]
        assert [s.status_code for s in streams] == [200] * MAX_INFLIGHT
        response = client.post(f"{gateway_url}/v1/completions", json=body)
        assert response.status_code == 429 and response.json()["error"]["code"] == "overloaded"
        assert response.headers["retry-after"] == "2"
        for s in streams:
            s.close()
    # the slots free up once the gateway saw the hang-ups
    wait_until_sync(lambda: httpx.get(f"{gateway_url}/health").status_code == 200, "/health 200", 5)
    ids = [r.request_id for r in peer.submits[-MAX_INFLIGHT:]]
    wait_until_sync(lambda: all(peer.cancel_reason(i) for i in ids), "every request cancelled", TIMEOUT_S + 2)


@pytest.fixture(scope="module")
def expected(peer):
    """The peer's reply cut after n tokens."""
    return lambda n: peer.tokenizer.decode(peer.reply_ids[:n])


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=10)


def test_sync_sdk_chat_and_completions(gateway_url, expected):
    client = sync_client(gateway_url)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1, temperature=0
    )
    assert chat.choices[0].message.content == expected(4)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 4 and chat.usage.total_tokens == chat.usage.prompt_tokens + 4
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert completion.choices[0].text == expected(3)
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_sync_sdk_streams(gateway_url, expected):
    client = sync_client(gateway_url)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected(5)
    assert chunks[-1].usage.completion_tokens == 5
    texts = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True)]
    assert "".join(texts) == expected(2)


async def test_async_sdk_chat_and_completions_streamed_and_not(gateway_url, expected):
    client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0, timeout=10)
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.content == expected(3)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == expected(3)
    completion = await client.completions.create(model="tiny", prompt="hello", max_tokens=2, logprobs=0)
    assert completion.choices[0].text == expected(2)
    assert len(completion.choices[0].logprobs.token_logprobs) == 2
    stream = await client.completions.create(model="tiny", prompt="hello", max_tokens=2, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == expected(2)
    await client.close()


def test_sdk_raises_its_typed_errors(gateway_url):
    client = sync_client(gateway_url)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_p=5)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="mode:overloaded")
    with pytest.raises(openai.APIError, match="decode worker crashed"):
        list(client.completions.create(model="tiny", prompt="mode:error", stream=True))

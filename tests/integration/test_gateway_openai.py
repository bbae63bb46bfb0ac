"""The official `openai` SDK (sync and async, streamed and not, chat and completions) against the
gateway, with the test peer of test_gateway_peer.py playing balancer + worker."""

from __future__ import annotations

import openai
import pytest

from test_gateway_peer import gateway_url, model_dir, peer  # noqa: F401  (module-scoped fixtures)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def expected(peer):  # noqa: F811
    """The peer's reply cut after n tokens."""
    return lambda n: peer.tokenizer.decode(peer.reply_ids[:n])


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=10)


def test_sync_sdk_chat_and_completions(gateway_url, expected):  # noqa: F811
    client = sync_client(gateway_url)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, seed=1, temperature=0)
    assert chat.choices[0].message.content == expected(4)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 4 and chat.usage.total_tokens == chat.usage.prompt_tokens + 4
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert completion.choices[0].text == expected(3)
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_sync_sdk_streams(gateway_url, expected):  # noqa: F811
    client = sync_client(gateway_url)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected(5)
    assert chunks[-1].usage.completion_tokens == 5
    texts = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                                                    stream=True)]
    assert "".join(texts) == expected(2)


async def test_async_sdk_chat_and_completions_streamed_and_not(gateway_url, expected):  # noqa: F811
    client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0, timeout=10)
    chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3)
    assert chat.choices[0].message.content == expected(3)
    stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == expected(3)
    completion = await client.completions.create(model="tiny", prompt="hello", max_tokens=2, logprobs=0)
    assert completion.choices[0].text == expected(2)
    assert len(completion.choices[0].logprobs.token_logprobs) == 2
    stream = await client.completions.create(model="tiny", prompt="hello", max_tokens=2, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == expected(2)
    await client.close()


def test_sdk_raises_its_typed_errors(gateway_url):  # noqa: F811
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

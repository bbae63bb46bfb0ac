"""HTTP bodies -> protocol messages (the one conversion), and token events -> OpenAI bodies/chunks."""

from __future__ import annotations

import pytest

from ferry.model.make_model import make_model
from ferry.model.tokenizer import Tokenizer
from ferry.protocol import TokenEvent, TokenLogprob
from ferry_services.gateway.convert import ModelLimits, chat_to_generate, completion_to_generate
from ferry_services.gateway.errors import APIError
from ferry_services.gateway.responses import Envelope, Output, delta_chunk, full_body, usage_chunk
from ferry_services.gateway.schemas import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.unit

LIMITS = ModelLimits(name="tiny", max_context_len=48, vocab_size=512)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_model(tmp_path_factory.mktemp("tiny"), "llama", "tiny"))


def chat(tok, **fields):
    body = ChatCompletionRequest(**{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **fields})
    return chat_to_generate(body, tok, LIMITS, "chatcmpl-1", "gw-1")


def completion(tok, **fields):
    body = CompletionRequest(**{"model": "tiny", "prompt": "hello", **fields})
    return completion_to_generate(body, tok, LIMITS, "cmpl-1", "gw-1")


def test_chat_prompt_is_the_rendered_template_with_one_bos(tok):
    request = chat(
        tok,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
        ],
    )
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    )
    assert request.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert request.prompt_token_ids.count(tok.token_id("bos_token")) == 1
    assert (request.request_id, request.gateway_id, request.model) == ("chatcmpl-1", "gw-1", "tiny")


def test_sampling_fields_map_onto_sampling_params(tok):
    s = chat(
        tok,
        temperature=0.2,
        top_p=0.5,
        seed=3,
        stop="END",
        max_tokens=4,
        presence_penalty=0.5,
        logprobs=True,
        top_logprobs=3,
        top_k=5,
        stop_token_ids=[9],
        ignore_eos=True,
    ).sampling
    assert (s.temperature, s.top_p, s.seed, s.stop, s.max_tokens) == (0.2, 0.5, 3, ["END"], 4)
    assert (s.presence_penalty, s.logprobs, s.top_k, s.stop_token_ids, s.ignore_eos) == (0.5, 3, 5, [9], True)
    defaults = chat(tok).sampling
    assert (defaults.temperature, defaults.top_p, defaults.logprobs, defaults.stop) == (1.0, 1.0, None, [])
    assert completion(tok, logprobs=0).sampling.logprobs == 0
    assert chat(tok, logprobs=True).sampling.logprobs == 0


def test_unset_max_tokens_fills_the_context(tok):
    request = chat(tok)
    assert request.sampling.max_tokens == LIMITS.max_context_len - len(request.prompt_token_ids)
    assert completion(tok).sampling.max_tokens == 16
    long_prompt = list(range(1, 40))
    assert completion(tok, prompt=long_prompt).sampling.max_tokens == LIMITS.max_context_len - 39
    assert chat(tok, max_completion_tokens=2, max_tokens=9).sampling.max_tokens == 2


def test_token_id_prompts_pass_through(tok):
    assert completion(tok, prompt=[5, 6, 7]).prompt_token_ids == [5, 6, 7]
    assert completion(tok, prompt=[[5, 6]]).prompt_token_ids == [5, 6]
    assert completion(tok, prompt=["hello"]).prompt_token_ids == tok.encode("hello")


def test_a_prompt_that_fills_the_context_is_rejected(tok):
    with pytest.raises(APIError) as err:
        completion(tok, prompt=list(range(LIMITS.max_context_len)))
    assert (err.value.status, err.value.param, err.value.code) == (400, "prompt", "context_length_exceeded")


def logprob(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, [token_id, 7], [-0.5, -2.0])


def event(ids: list[int], text: str, finish: str | None = None, lp: bool = False) -> TokenEvent:
    return TokenEvent(
        "r",
        0,
        ids,
        text=text,
        finish_reason=finish,
        num_prompt_tokens=11,
        logprobs=[logprob(i) for i in ids] if lp else None,
    )


def test_completion_body_with_logprobs_and_usage(tok):
    out = Output(num_prompt_tokens=3)
    ids = tok.encode("the boat", add_special_tokens=False)
    out.add(event(ids, "the boat", "stop", lp=True))
    body = full_body(Envelope("cmpl-1", "tiny", is_chat=False), out, tok, want_logprobs=True)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "the boat"
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": len(ids), "total_tokens": 11 + len(ids)}
    lp = body["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == "the boat"
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert list(lp["top_logprobs"][0].values()) == [-0.5, -2.0]


def test_chat_chunks_and_usage_chunk(tok):
    env = Envelope("chatcmpl-1", "tiny", is_chat=True)
    chunk = delta_chunk(env, event([5], "hi"), tok, 0, want_logprobs=False, include_usage=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert chunk["choices"][0] == {"index": 0, "finish_reason": None, "logprobs": None, "delta": {"content": "hi"}}
    last = delta_chunk(env, event([], "", "length"), tok, 2, want_logprobs=True, include_usage=False)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["logprobs"] == {"content": []} and "usage" not in last
    out = Output(num_prompt_tokens=11)
    out.add(event([5, 6], "hi!", "stop"))
    assert usage_chunk(env, out)["choices"] == [] and usage_chunk(env, out)["usage"]["completion_tokens"] == 2


def test_return_token_ids_adds_the_output_ids_to_chunks_and_bodies(tok):
    env = Envelope("cmpl-1", "tiny", is_chat=False, return_token_ids=True)
    chunk = delta_chunk(env, event([5, 6], "hi"), tok, 0, want_logprobs=False, include_usage=False)
    assert chunk["choices"][0]["token_ids"] == [5, 6]
    out = Output(num_prompt_tokens=3)
    out.add(event([5, 6], "hi"))
    out.add(event([7], "!", "stop"))
    assert full_body(env, out, tok, want_logprobs=False)["choices"][0]["token_ids"] == [5, 6, 7]
    plain = Envelope("cmpl-2", "tiny", is_chat=False)
    assert "token_ids" not in delta_chunk(plain, event([5], "hi"), tok, 0, want_logprobs=False, include_usage=False)

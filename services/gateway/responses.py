"""OpenAI response bodies and stream chunks built from token events.

Completions and chat share one accumulation (`Output`); they differ only in where text and
logprobs go: `choices[0].text` + `logprobs.{tokens,token_logprobs,top_logprobs,text_offset}` vs.
`choices[0].message|delta.content` + `logprobs.content[]`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ferry.protocol import TokenEvent, TokenLogprob
from ferry_services.gateway.tokenizer import Tokenizer


@dataclass(slots=True)
class Output:
    """Everything received for one request so far."""

    num_prompt_tokens: int
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.num_tokens += len(event.token_ids)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        self.finish_reason = event.finish_reason or self.finish_reason
        if event.num_prompt_tokens:
            self.num_prompt_tokens = event.num_prompt_tokens

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_tokens,
        }


@dataclass(slots=True)
class Envelope:
    """The fields every body and chunk of one request repeats."""

    id: str
    model: str
    is_chat: bool
    return_token_ids: bool = False
    """Choices carry `token_ids` too (the request's vLLM-style `return_token_ids`)."""
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.is_chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(entries: list[TokenLogprob], tokenizer: Tokenizer, text_offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(text_offset)
        tokens.append(token_text(tokenizer, entry.token_id))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {token_text(tokenizer, t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)} for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], tokenizer: Tokenizer) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for e in entries:
        top = [item(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)]
        content.append({**item(e.token_id, e.logprob), "top_logprobs": top})
    return {"content": content}


def _logprobs(
    env: Envelope, entries: list[TokenLogprob] | None, tokenizer: Tokenizer, text_offset: int
) -> dict[str, Any] | None:
    if entries is None:
        return None
    return chat_logprobs(entries, tokenizer) if env.is_chat else completion_logprobs(entries, tokenizer, text_offset)


def full_body(env: Envelope, out: Output, tokenizer: Tokenizer, want_logprobs: bool) -> dict[str, Any]:
    """The non-streamed answer."""
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": out.finish_reason,
        "logprobs": _logprobs(env, out.logprobs if want_logprobs else None, tokenizer, 0),
    }
    if env.is_chat:
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
    if env.return_token_ids:
        choice["token_ids"] = list(out.token_ids)
    return {**env.wrap([choice], chunk=False), "usage": out.usage()}


def delta_chunk(
    env: Envelope, event: TokenEvent, tokenizer: Tokenizer, text_offset: int, want_logprobs: bool, include_usage: bool
) -> dict[str, Any]:
    """One streamed chunk for one token event (text delta, logprobs, maybe the finish reason)."""
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": event.finish_reason,
        "logprobs": _logprobs(env, (event.logprobs or []) if want_logprobs else None, tokenizer, text_offset),
    }
    if env.is_chat:
        choice["delta"] = {"content": event.text} if event.text or not event.finish_reason else {}
    else:
        choice["text"] = event.text
    if env.return_token_ids:
        choice["token_ids"] = list(event.token_ids)
    return _with_usage_slot(env.wrap([choice], chunk=True), include_usage)


def role_chunk(env: Envelope, include_usage: bool) -> dict[str, Any]:
    """Chat streams open with the assistant role and empty content, as OpenAI's do."""
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return _with_usage_slot(env.wrap([choice], chunk=True), include_usage)


def usage_chunk(env: Envelope, out: Output) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the request's usage."""
    return {**env.wrap([], chunk=True), "usage": out.usage()}


def _with_usage_slot(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    # With include_usage every chunk carries "usage": null until the final usage chunk.
    return {**chunk, "usage": None} if include_usage else chunk

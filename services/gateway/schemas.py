"""HTTP request bodies of the OpenAI API (pydantic). They live here only: `convert.py` turns them
into protocol messages. Unknown fields are ignored as OpenAI clients send many optional ones;
fields that would change the answer in a way we do not support are rejected by name."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Stop = str | list[str] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM-style extensions
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    return_token_ids: bool = Field(
        default=False, description="each choice (and stream chunk) also carries its output token ids (vLLM's)"
    )

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: Stop) -> Stop:
        items = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(CommonFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = Field(default=False, description="echoing the prompt is not supported")
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: None = Field(default=None, description="insertion is not supported")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

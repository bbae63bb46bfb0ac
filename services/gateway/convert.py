"""The one place where HTTP request bodies become protocol messages.

Validation that needs the model (token ids in range, prompt vs. context length, chat template)
happens here too, so every `APIError` for a bad body names the field a client must fix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ferry.protocol import GenerateRequest, SamplingParams
from ferry_services.gateway.errors import APIError, bad_request
from ferry_services.gateway.schemas import ChatCompletionRequest, CommonFields, CompletionRequest
from ferry_services.gateway.tokenizer import Tokenizer


@dataclass(slots=True)
class ModelLimits:
    name: str
    """The model name clients must send."""
    max_context_len: int
    """Prompt + generated tokens may not exceed this."""
    vocab_size: int
    """Token ids in a prompt must be below this (0 = unchecked)."""
    arch: str = ""
    """For /v1/models: the architecture (llama, qwen2, ...)."""
    checkpoint_dtype: str = ""
    """For /v1/models: what the checkpoint stores its weights in (Q4_1, bfloat16, ...)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.max_context_len < 2:
            raise ValueError(f"max_context_len={self.max_context_len}: must be >= 2 (a prompt and a token)")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size={self.vocab_size}: must be >= 0")


def check_model(requested: str, limits: ModelLimits) -> None:
    if requested != limits.name:
        raise APIError(
            404,
            f"The model `{requested}` does not exist; this server serves `{limits.name}`.",
            param="model",
            code="model_not_found",
        )


def completion_prompt_ids(body: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("prompt", f"got a batch of {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = list(prompt)
        bad = next((t for t in ids if t < 0 or (limits.vocab_size and t >= limits.vocab_size)), None)
        if bad is not None:
            raise bad_request("prompt", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if not ids:
        raise bad_request("prompt", "the prompt is empty")
    return ids


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    messages = [{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except Exception as exc:  # a template's raise_exception(...) rejects the conversation's shape
        raise bad_request("messages", f"the chat template rejected the messages: {exc}") from None
    # The template writes the special tokens (BOS, role markers) itself.
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("messages", "the messages render to an empty prompt")
    return ids


def resolve_max_tokens(
    requested: int | None,
    field_name: str,
    prompt_field: str,
    num_prompt_tokens: int,
    limits: ModelLimits,
    default: int | None,
) -> int:
    """Check prompt + max_tokens against the context; an unset max_tokens fills what is left."""
    room = limits.max_context_len - num_prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_context_len} tokens, "
            f"but the prompt has {num_prompt_tokens} tokens.",
            param=prompt_field,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_context_len} tokens; "
            f"the prompt has {num_prompt_tokens} tokens and {field_name}={requested} "
            f"asks for {requested} more.",
            param=field_name,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(body: CommonFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            stop=body.stop_list,
            stop_token_ids=list(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:  # SamplingParams names the field: "top_p=0 must be in (0, 1]"
        text = str(exc)
        raise bad_request(text.split("=", 1)[0], text) from None


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs=true")
    return (body.top_logprobs or 0) if body.logprobs else None


def completion_to_generate(
    body: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits, request_id: str, gateway_id: str
) -> GenerateRequest:
    check_model(body.model, limits)
    ids = completion_prompt_ids(body, tokenizer, limits)
    explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
    max_tokens = resolve_max_tokens(explicit, "max_tokens", "prompt", len(ids), limits, default=16)
    return _generate(ids, sampling_params(body, max_tokens, body.logprobs), limits, request_id, gateway_id)


def chat_to_generate(
    body: ChatCompletionRequest, tokenizer: Tokenizer, limits: ModelLimits, request_id: str, gateway_id: str
) -> GenerateRequest:
    check_model(body.model, limits)
    logprobs = chat_logprobs(body)
    ids = chat_prompt_ids(body, tokenizer)
    field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(body.requested_max_tokens, field_name, "messages", len(ids), limits, default=None)
    return _generate(ids, sampling_params(body, max_tokens, logprobs), limits, request_id, gateway_id)


def _generate(
    ids: list[int], sampling: SamplingParams, limits: ModelLimits, request_id: str, gateway_id: str
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        gateway_id=gateway_id,
        model=limits.name,
        prompt_token_ids=ids,
        sampling=sampling,
        arrival_time=time.time(),
    )

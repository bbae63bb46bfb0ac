"""The FastAPI app: OpenAI routes, health and readiness. No NATS setup here (see service.py), so
tests can drive the app with any connected or unconnected `GatewayBus`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.types import Receive, Scope, Send

from ferry.bus import trace
from ferry.protocol import ROLES, GenerateRequest
from ferry_services.gateway.auth import ApiKeys, install_guard, lone_surrogate_field
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.convert import ModelLimits, chat_to_generate, completion_to_generate
from ferry_services.gateway.errors import APIError, bad_request, install_error_handlers
from ferry_services.gateway.generation import Generation, check_inflight
from ferry_services.gateway.responses import Envelope, Output, delta_chunk, full_body, role_chunk, usage_chunk
from ferry_services.gateway.schemas import ChatCompletionRequest, CommonFields, CompletionRequest
from ferry_services.gateway.settings import GatewaySettings
from ferry_services.gateway.tokenizer import Tokenizer


def create_app(settings: GatewaySettings, tokenizer: Tokenizer, limits: ModelLimits, bus: GatewayBus) -> FastAPI:
    app = FastAPI(title="ferry gateway", version="0.1.0")
    install_error_handlers(app)
    install_guard(app, ApiKeys.from_settings(settings.api_keys, settings.api_key_file), settings.max_body_bytes)
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        now = time.monotonic()
        workers = {role: bus.workers.alive(role, now) for role in ROLES}
        missing = [role for role, ids in workers.items() if not ids]
        is_ready = bus.is_connected and not missing
        status = (
            "ready"
            if is_ready
            else ("bus not connected" if not bus.is_connected else f"no live {' or '.join(missing)} worker")
        )
        return JSONResponse(
            {"status": status, "bus_connected": bus.is_connected, "workers": workers},
            status_code=200 if is_ready else 503,
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(limits, created, bus)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != limits.name:
            raise APIError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")
        return _model_card(limits, created, bus)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _require_valid_unicode(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        trace.hop(request_id, "gw.http")
        check_inflight(bus, settings.max_inflight, settings.retry_after_s)  # before the tokenizer runs
        generate = completion_to_generate(body, tokenizer, limits, request_id, bus.gateway_id)
        env = Envelope(id=request_id, model=limits.name, is_chat=False, return_token_ids=body.return_token_ids)
        return await _respond(request, body, generate, env, body.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _require_valid_unicode(body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        check_inflight(bus, settings.max_inflight, settings.retry_after_s)  # before the chat template runs
        generate = chat_to_generate(body, tokenizer, limits, request_id, bus.gateway_id)
        env = Envelope(id=request_id, model=limits.name, is_chat=True, return_token_ids=body.return_token_ids)
        return await _respond(request, body, generate, env, body.logprobs)

    async def _respond(
        request: Request, body: CommonFields, generate: GenerateRequest, env: Envelope, want_logprobs: bool
    ) -> Response:
        gen = Generation(bus, generate, settings.request_timeout_s, settings.max_attempts)
        await gen.start(settings.max_inflight, settings.retry_after_s, time.monotonic())
        out = Output(num_prompt_tokens=len(generate.prompt_token_ids))
        if body.stream:
            chunks = _sse(gen, env, out, tokenizer, want_logprobs, body.include_usage)
            return GenerationStream(chunks, gen)
        try:
            await _collect_unless_disconnected(request, gen, out)
        finally:
            await gen.close()
        return JSONResponse(full_body(env, out, tokenizer, want_logprobs))

    return app


def _require_valid_unicode(body: CommonFields) -> None:
    field = lone_surrogate_field(body.model_dump())
    if field:
        raise bad_request(field, "contains a lone UTF-16 surrogate (\\ud800-\\udfff); send valid Unicode")


def _model_card(limits: ModelLimits, created: int, bus: GatewayBus) -> dict[str, Any]:
    """OpenAI's model object plus what is served: architecture, the checkpoint's dtype and the weights
    dtype the live workers multiply with (comma separated if they differ; null before any reports)."""
    weights = bus.workers.weights_dtypes(time.monotonic())
    return {
        "id": limits.name,
        "object": "model",
        "created": created,
        "owned_by": "ferry",
        "max_model_len": limits.max_context_len,
        "architecture": limits.arch or None,
        "checkpoint_dtype": limits.checkpoint_dtype or None,
        "weights_dtype": ",".join(weights) or None,
    }


async def _collect(gen: Generation, out: Output) -> None:
    async for event in gen.events():
        out.add(event)


async def _collect_unless_disconnected(request: Request, gen: Generation, out: Output) -> None:
    """Wait for the whole answer, but stop at once if the client hangs up (close() cancels)."""
    collect = asyncio.ensure_future(_collect(gen, out))
    hangup = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collect, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, hangup):
            if not task.done():
                task.cancel()
    if not collect.done() or collect.cancelled():
        raise APIError(499, "client closed the request", code="client_disconnected")
    collect.result()  # re-raises the APIError of an error event or timeout


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse_line(payload: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False))


async def _sse(
    gen: Generation, env: Envelope, out: Output, tokenizer: Tokenizer, want_logprobs: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    if env.is_chat:
        yield _sse_line(role_chunk(env, include_usage))
    try:
        async for events in gen.event_batches():
            lines = []
            for event in events:
                text_offset = len(out.text)
                out.add(event)
                if event.index == 0:
                    trace.hop(env.id, "gw.sse")
                lines.append(_sse_line(delta_chunk(env, event, tokenizer, text_offset, want_logprobs, include_usage)))
            yield b"".join(lines)  # one write per run of queued events (one SSE event per token still)
    except APIError as exc:  # headers are sent: the error travels as an event, as OpenAI's do
        yield _sse_line(exc.body())
    else:
        if include_usage:
            yield _sse_line(usage_chunk(env, out))
    yield format_sse_event(data_str="[DONE]")


class GenerationStream(EventSourceResponse):
    """An SSE response (FastAPI's: text/event-stream, events framed by format_sse_event) that closes
    its generation however the response ends: finished, failed, or the client disconnected (even
    before the first byte, when the body never started)."""

    def __init__(self, chunks: AsyncIterator[bytes], gen: Generation) -> None:
        super().__init__(chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._gen.close())

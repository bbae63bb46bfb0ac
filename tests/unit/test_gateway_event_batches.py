"""Generation.event_batches: a stream's queued token events come out together (one SSE write),
in order, and events that arrived before an error are still delivered before it is raised."""

from __future__ import annotations

import asyncio

import pytest

from ferry.protocol import ErrorEvent, GenerateRequest, SamplingParams, TokenEvent
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.errors import APIError
from ferry_services.gateway.generation import Generation

pytestmark = pytest.mark.unit


def generation() -> Generation:
    request = GenerateRequest("r1", "gw", "m", [1, 2, 3], SamplingParams(max_tokens=8))
    gen = Generation(GatewayBus("gw"), request, timeout_s=5.0)
    gen._queue = asyncio.Queue()
    return gen


def token(index: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r1", index, [10 + index], text=f"t{index}", finish_reason=finish)


def test_queued_events_come_out_as_one_batch_and_later_ones_as_their_own():
    async def run() -> list[list[int]]:
        gen = generation()
        for i in range(3):
            gen._queue.put_nowait(token(i))
        batches = []
        async for batch in gen.event_batches():
            batches.append([e.index for e in batch])
            if len(batches) == 1:  # the worker's next step: one more token, then the last one
                gen._queue.put_nowait(token(3))
            elif len(batches) == 2:
                gen._queue.put_nowait(token(4, "length"))
        return batches

    assert asyncio.run(run()) == [[0, 1, 2], [3], [4]]


def test_events_before_an_error_are_delivered_then_the_error_raised():
    async def run() -> tuple[list[list[int]], APIError | None]:
        gen = generation()
        gen._queue.put_nowait(token(0))
        gen._queue.put_nowait(token(1))
        gen._queue.put_nowait(ErrorEvent("r1", "internal", "boom"))
        batches, error = [], None
        try:
            async for batch in gen.event_batches():
                batches.append([e.index for e in batch])
        except APIError as exc:
            error = exc
        return batches, error

    batches, error = asyncio.run(run())
    assert batches == [[0, 1]]
    assert error is not None and error.status == 500

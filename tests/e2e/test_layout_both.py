"""`ferry up --layout both`: workers that prefill and decode (FERRY_ROLE=both), no hand-off.

The client-visible tests of the split system run here too, against two both-role workers (the
module's `system` fixture replaces conftest's): equal streaming and whole outputs, greedy output
equal to `ferry generate`, a cancelled stream frees its blocks. Then what only this layout does:
each request's tokens all come from the worker that prefilled it, and nothing is handed off."""

from __future__ import annotations

import asyncio

import pytest
from system_launch import pid_alive, start_system
from test_system_openai import (  # noqa: F401  (collected here, against this module's system)
    GREEDY,
    PROMPTS,
    async_client,
    test_cancelled_stream_frees_its_blocks_on_every_worker,
    test_greedy_output_through_the_system_equals_ferry_generate,
    test_sync_completions_and_chat_streaming_and_not,
    watch,
)

from ferry.protocol import OutputBatch
from ferry.protocol.subjects import HANDOFF

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def system(e2e_model, nats_url, redis_url, tmp_path_factory):
    running = start_system(e2e_model, nats_url, redis_url, tmp_path_factory.mktemp("run-both"), both=2)
    yield running
    assert running.stop() == 0
    assert [name for name, pid in running.pids.items() if pid_alive(pid)] == []


async def test_both_workers_serve_whole_requests_without_handoffs(system, nats_url):
    batches: list[OutputBatch] = []
    handoffs: list = []
    nc = await watch(nats_url, "ferry.out.>", OutputBatch, batches)

    async def count_handoff(msg) -> None:
        handoffs.append(msg)

    await nc.subscribe(HANDOFF, cb=count_handoff)
    client = async_client(system)
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    results = await asyncio.gather(
        *(client.completions.create(model=system.model_name, prompt=p, **GREEDY) for p in prompts)
    )
    assert all(r.usage.completion_tokens == 10 for r in results)
    await nc.flush()
    await nc.close()
    await client.close()
    emitters: dict[str, set[str]] = {}
    for batch in batches:
        for event in batch.tokens:
            emitters.setdefault(event.request_id, set()).add(batch.worker_id)
    assert len(emitters) == len(prompts) and all(len(w) == 1 for w in emitters.values())
    assert sorted({w.rsplit("-", 1)[0] for ws in emitters.values() for w in ws}) == ["both-0", "both-1"]
    assert handoffs == []

"""Prefix reuse through the Redis store, over real nats-server and redis-server: a prefill worker
whose pool no longer holds a prompt's prefix fetches the blocks another prefill stored and
computes only the suffix; a corrupt stored block means recompute; greedy output stays exact."""

from __future__ import annotations

import asyncio

import pytest
from test_worker_pipeline import GREEDY, Client, System

from ferry.kvstore import block_key
from ferry.protocol import hash_full_blocks
from ferry_services.worker.service import build_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 16
PREFIX = [(7 * i + 5) % 200 + 3 for i in range(4 * BLOCK)]  # 4 full blocks shared by both prompts
FIRST = PREFIX + list(range(3, 13))
SECOND = PREFIX + list(range(40, 60))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", "tiny")


@pytest.fixture(scope="module")
def reference(tiny_model):
    from ferry.engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_model_path(tiny_model, EngineConfig(num_kv_blocks=128, enable_prefix_caching=False))
    engine.add_request("second", SECOND, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.fixture
async def system(nc, nats_url, redis_url, redis, tiny_model):
    system = System(nats_url, redis_url, tiny_model)
    await system.start()
    await system.until_reported()
    yield system
    await system.stop()


@pytest.fixture
async def client(nc):
    c = Client(nc)
    await c.start()
    return c


async def clear_pool(worker) -> None:
    """A fresh engine (as after a restart): nothing of the earlier prompts is in its pool."""
    fresh = await asyncio.to_thread(build_engine, worker.settings)
    await worker.compute.call(lambda: None)  # let the running step finish first
    worker.engine = worker.compute.engine = fresh


async def serve(client, request_id: str, prompt: list[int]) -> list[int]:
    assert (await client.submit(request_id, prompt)).accepted
    await client.wait_finished([request_id])
    assert client.errors == []
    return client.tokens[request_id]


async def test_second_prompt_fetches_the_stored_prefix_and_computes_only_the_suffix(system, client, reference):
    prefill = system.workers["prefill-t"]
    await serve(client, "first", FIRST)
    await clear_pool(prefill)
    assert await serve(client, "second", SECOND) == reference
    stats = prefill.engine.stats()
    assert (stats.num_cached_tokens, stats.num_computed_tokens) == (len(PREFIX), len(SECOND) - len(PREFIX))
    assert (prefill.num_prefix_blocks_reused, prefill.num_prefix_fetch_failures) == (4, 0)


async def test_local_pool_hit_needs_no_fetch(system, client, reference):
    prefill = system.workers["prefill-t"]
    await serve(client, "first", FIRST)
    assert await serve(client, "second", SECOND) == reference
    assert prefill.engine.stats().num_cached_tokens == len(PREFIX)  # from its own pool
    assert prefill.num_prefix_blocks_reused == 0


async def test_corrupt_stored_block_means_recompute_with_the_right_tokens(system, client, reference, redis):
    prefill = system.workers["prefill-t"]
    await serve(client, "first", FIRST)
    key = block_key(prefill.namespace, hash_full_blocks(FIRST, BLOCK)[1])
    value = bytearray(await redis.get(key))
    value[-1] ^= 0xFF  # one flipped payload byte: the crc no longer matches
    await redis.set(key, bytes(value))
    await clear_pool(prefill)
    assert await serve(client, "second", SECOND) == reference
    stats = prefill.engine.stats()
    assert (stats.num_cached_tokens, stats.num_computed_tokens) == (0, len(SECOND))
    assert (prefill.num_prefix_blocks_reused, prefill.num_prefix_fetch_failures) == (0, 1)


async def test_same_prefix_burst_spreads_over_prefill_workers(system, client):
    await system.start_worker("prefill", "prefill-2")
    await system.until_reported("prefill-2")
    burst = [PREFIX + [3 + i, 4 + i, 5 + i] for i in range(6)]
    replies = await asyncio.gather(*(client.submit(f"b{i}", p) for i, p in enumerate(burst)))
    assert all(r.accepted for r in replies), replies
    assert {r.worker_id for r in replies} == {"prefill-t", "prefill-2"}
    await client.wait_finished([f"b{i}" for i in range(len(burst))])
    assert client.errors == []


async def test_idle_workers_route_a_known_prefix_to_the_pool_that_holds_it(system, client):
    await system.start_worker("prefill", "prefill-2")
    await system.until_reported("prefill-2")
    holder = (await client.submit("first", FIRST)).worker_id
    await client.wait_finished(["first"])
    await system.until_reported()  # fresh load reports: nothing queued anywhere
    replies = [await client.submit(f"again{i}", PREFIX + [9, i]) for i in range(3)]
    await client.wait_finished([f"again{i}" for i in range(3)])
    assert [r.worker_id for r in replies] == [holder] * 3
    assert system.workers[holder].engine.stats().num_cached_tokens >= 3 * len(PREFIX)

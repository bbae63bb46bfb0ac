"""Multi-turn KV over real nats-server and redis-server (+ the kvcache service): a decode worker writes
a finished turn's output blocks back to the store and says so (`KvWarm`), the prefill-balancer has the
prefill worker that holds the conversation's head fetch the rest into its host tier before the next
turn is even sent, and the prefilled next turn finds its whole history local (pool + host tier) with
the exact greedy tokens."""

from __future__ import annotations

import asyncio

import pytest
from test_kvcache_service import Running, healthy
from test_prefix_reuse import PREFIX, client, tiny_model  # noqa: F401
from test_worker_pipeline import GREEDY, System
from waiting import wait_until

from ferry.protocol import (
    Cancel,
    KvPrefetch,
    SamplingParams,
    decode,
    encode,
    hash_full_blocks,
    hash_partial_block,
    subjects,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TURN_1 = PREFIX + list(range(3, 13))  # 74 tokens
LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
USER_2 = [21, 22, 23, 24, 25]


@pytest.fixture
async def system(nc, nats_url, redis_url, redis, tiny_model):
    async with Running(nats_url, redis_url):
        await healthy(nc)
        system = System(nats_url, redis_url, tiny_model, host_kv_blocks=64)
        await system.start()
        await asyncio.sleep(0.5)  # first load reports reach the balancers
        yield system
        await system.stop()


def expected_tokens(tiny_model, prompt):
    from ferry.engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_model_path(tiny_model, EngineConfig(num_kv_blocks=128, enable_prefix_caching=False))
    engine.add_request("ref", prompt, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


async def serve(client, request_id, prompt, sampling=GREEDY):
    assert (await client.submit(request_id, prompt, sampling)).accepted
    await client.wait_finished([request_id])
    assert client.errors == []
    return client.tokens[request_id]


async def collect_prefetches(nc, worker_id: str) -> list[KvPrefetch]:
    """Every KvPrefetch sent to worker_id from now on, in arrival order."""
    prefetches: list[KvPrefetch] = []

    async def collect(msg) -> None:
        prefetches.append(decode(msg.data))

    await nc.subscribe(subjects.kv_prefetch(worker_id), cb=collect)
    return prefetches


async def test_next_turn_finds_its_history_warmed_up(system, nc, client, tiny_model):
    prefill, decode_worker = system.workers["prefill-t"], system.workers["decode-t"]
    prefetches = await collect_prefetches(nc, prefill.worker_id)
    output_1 = await serve(client, "turn-1", TURN_1, LONG)
    history = TURN_1 + output_1  # 114 tokens; the last one's KV is not computed
    await wait_until(
        lambda: decode_worker.num_written_back_blocks, "the decode worker wrote turn 1's output blocks back"
    )
    hashes = hash_full_blocks(history[:-1], 16)
    # from the block that holds the prompt's tail on, and the partial last block (1 token: 113 computed)
    written = hashes[len(TURN_1) // 16 :] + [hash_partial_block(hashes[-1], history[112:113])]
    assert decode_worker.num_written_back_blocks == len(written)
    # turn end: the decode worker's KvWarm made the balancer send the prefill worker (which holds the
    # prompt's blocks) a warm-up of exactly the blocks it lacks, fetched before any next turn exists
    await wait_until(
        lambda: prefill.prefetcher.stats.num_fetched_blocks == len(written),
        "the warm-up fetched every written-back block",
    )
    assert [(p.warm, p.block_hashes) for p in prefetches] == [(True, written)]
    assert prefill.prefetcher.stats.num_warm == 1

    turn_2 = history + USER_2
    assert _only_in_store(system, prefill, turn_2) == []  # the balancer counts them in the worker's host tier
    assert await serve(client, "turn-2", turn_2) == expected_tokens(tiny_model, turn_2)
    tiers = prefill.prefix_blocks_by_tier
    num_prompt_blocks = len(TURN_1) // 16
    assert tiers["computed"] == num_prompt_blocks  # turn 1: nothing cached anywhere yet
    assert (tiers["device"], tiers["host"], tiers["remote"]) == (num_prompt_blocks, len(written) - 1, 0)  # turn 2
    assert prefill.engine.stats().num_partial_hit_tokens == 1  # turn 1's last computed token: copied, not computed
    assert not [p for p in prefetches if p.request_id == "turn-2"]  # nothing left for the routing to fetch


async def test_a_partial_only_warm_up_names_the_block_its_next_turn_extends(system, nc, client, tiny_model):
    prefill, decode_worker = system.workers["prefill-t"], system.workers["decode-t"]
    prefetches = await collect_prefetches(nc, prefill.worker_id)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    history = TURN_1 + await serve(client, "turn-1", TURN_1, short)  # 78 tokens: 77 computed, 4 full blocks
    hashes = hash_full_blocks(history[:-1], 16)
    partial = hash_partial_block(hashes[-1], history[64:77])
    # the prefill worker holds the 4 full blocks (it computed them): the warm-up's only block to fetch is the
    # partial one, and it also names the full block that partial one follows, so that the next turn's
    # admission (Prefetcher.settle matches by full blocks) waits for it or takes it back
    await wait_until(lambda: prefetches, "the turn end's warm-up")
    assert [(p.warm, p.block_hashes) for p in prefetches] == [(True, [hashes[-1], partial])]
    await wait_until(lambda: prefill.prefetcher.stats.num_fetched_blocks == 1, "the warm-up fetched the partial block")
    assert decode_worker.num_written_back_blocks == 1
    turn_2 = history + USER_2
    assert await serve(client, "turn-2", turn_2) == expected_tokens(tiny_model, turn_2)
    assert prefill.engine.stats().num_partial_hit_tokens == 13  # turn 1's tail: copied, not computed


async def test_a_cancelled_requests_prefetch_is_dropped(system, nc):
    prefill = system.workers["prefill-t"]
    prefill.prefetcher._wake = asyncio.Event()  # park the loop's wake-up: the offer stays queued
    await prefill.prefetcher.offer(KvPrefetch("gone", prefill.namespace, hash_full_blocks(PREFIX, 16)))
    await nc.publish(subjects.CANCEL, encode(Cancel(["gone"])))
    await wait_until(lambda: prefill.prefetcher.stats.num_dropped == 1, "the cancelled prefetch dropped")
    assert prefill.prefetcher.stats.num_fetched_blocks == 0


def _only_in_store(system, prefill, prompt):
    balancer = next(s.__self__ for s in system.stoppers if type(s.__self__).__name__ == "PrefillBalancer")
    hashes = hash_full_blocks(prompt, 16)[: (len(prompt) - 1) // 16]
    return balancer.prefixes.only_in_store(prefill.namespace, prefill.worker_id, hashes)


async def test_a_both_roles_worker_writes_the_whole_conversation_back(system, client):
    both = await system.start_worker("both", "both-t", host_kv_blocks=64)
    await system.stop_worker("prefill-t")  # draining: turn 1 goes to the both-roles worker
    await system.until_reported("both-t")
    output_1 = await serve(client, "turn-1", TURN_1, LONG)
    assert system.workers["decode-t"].num_written_back_blocks == 0  # it never left the both-roles worker
    await wait_until(lambda: both.num_written_back_blocks, "the both-roles worker wrote turn 1 back")
    history = (TURN_1 + output_1)[:-1]
    chain = hash_full_blocks(history, 16)
    partial = hash_partial_block(chain[-1], history[len(chain) * 16 :])
    assert both.num_written_back_blocks == len(chain) + 1  # nothing of it was in the store before
    assert await both.store.lookup(chain + [partial]) == len(chain) + 1


async def test_after_every_worker_restarts_the_conversation_is_warmed_up_again(system, client, tiny_model):
    """Host tiers and pools gone, Redis still holding the blocks: the prefill-balancer replays the latest
    warm-ups into the restarted prefill worker once it reports, before the next turn is sent."""
    output_1 = await serve(client, "turn-1", TURN_1, LONG)
    history = TURN_1 + output_1
    chain = hash_full_blocks(history[:-1], 16)
    written = chain[len(TURN_1) // 16 :] + [hash_partial_block(chain[-1], history[len(chain) * 16 : -1])]
    await wait_until(
        lambda: system.workers["prefill-t"].prefetcher.stats.num_fetched_blocks == len(written), "turn 1 warmed up"
    )
    for worker_id in ("prefill-t", "decode-t"):
        await system.stop_worker(worker_id)
    decode_worker = await system.start_worker("decode", "decode-t")
    prefill = await system.start_worker("prefill", "prefill-t")
    # nothing of the conversation is in the new pool or host tier: the whole chain is fetched again,
    # with its partial last block
    await wait_until(
        lambda: prefill.prefetcher.stats.num_fetched_blocks == len(chain) + 1,
        "the restarted prefill worker warmed up with the whole history",
    )
    assert prefill.prefetcher.stats.num_warm == 1
    turn_2 = history + USER_2
    assert _only_in_store(system, prefill, turn_2) == []
    assert await serve(client, "turn-2", turn_2) == expected_tokens(tiny_model, turn_2)
    tiers = prefill.prefix_blocks_by_tier
    assert (tiers["device"], tiers["host"], tiers["remote"]) == (0, len(chain), 0)
    # and the turn after that is warmed up as before, by the restarted decode worker's write-back
    output_2 = client.tokens["turn-2"]
    await wait_until(lambda: decode_worker.num_written_back_blocks, "turn 2 written back")
    chain_2 = hash_full_blocks((turn_2 + output_2)[:-1], 16)
    await wait_until(
        lambda: prefill.prefetcher.stats.num_warm == 2 and prefill.engine.num_cached_blocks(chain_2) == len(chain_2),
        "turn 2's chain is local to the prefill worker",
    )

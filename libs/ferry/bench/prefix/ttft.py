"""TTFT of a shared-system-prompt workload on a prefill-role engine, three ways side by side:
cold (no prefix cache), prefix fetched from the Redis store (the prefill worker's path:
lookup -> get_blocks -> add_prefilled), and prefix already in the engine's own pool.

Modes run interleaved request by request, so machine noise hits all three alike.
"""

from __future__ import annotations

import random
import statistics
import time

from ferry.engine import EngineConfig, LLMEngine
from ferry.kvstore import KvStore, RedisTransport
from ferry.protocol import SamplingParams, hash_full_blocks

FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
MODES = ("cold", "store", "pool")


def first_token(engine: LLMEngine, request_id: str) -> int:
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                return out.new_token_ids[0]


def make_prompts(vocab: int, system_tokens: int, user_tokens: int, num: int, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
    users = [[rng.randrange(3, vocab) for _ in range(user_tokens)] for _ in range(num)]
    return system, users


async def seed_store(engine: LLMEngine, store: KvStore, prompt: list[int], block_size: int) -> None:
    """What an earlier prefill worker left behind: the system prompt's full blocks under their hashes."""
    engine.add_request("seed", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    first_token(engine, "seed")
    kv = engine.take_prefilled("seed")
    num_full = len(prompt) // block_size
    await store.put_blocks(kv.block_hashes[:num_full], kv.data[:num_full])


async def via_store(engine: LLMEngine, store: KvStore, request_id: str, prompt: list[int], block_size: int) -> tuple:
    hashes = hash_full_blocks(prompt, block_size)[: (len(prompt) - 1) // block_size]
    num_stored = await store.lookup(hashes)
    data = await store.get_blocks(hashes[:num_stored])
    engine.add_prefilled(request_id, prompt, [], FIRST, data, num_stored * block_size, count_as_cached=True)
    return first_token(engine, request_id), num_stored


async def measure_ttft(
    lm,
    redis_url: str,
    system_tokens: int = 576,
    user_tokens: int = 64,
    num_requests: int = 8,
    block_size: int = 16,
    seed: int = 0,
) -> dict:
    def engine(caching: bool) -> LLMEngine:
        return LLMEngine(
            lm,
            EngineConfig(
                block_size=block_size,
                num_kv_blocks=512,
                role="prefill",
                enable_prefix_caching=caching,
                max_num_batched_tokens=4096,
            ),
        )

    engines = {"cold": engine(False), "store": engine(True), "pool": engine(True)}
    transport = RedisTransport(redis_url)
    store = KvStore(transport, namespace=lm.fingerprint)
    system, users = make_prompts(lm.config.vocab_size, system_tokens, user_tokens, num_requests, seed)
    await seed_store(engines["pool"], store, system, block_size)  # also warms the 'pool' engine's cache
    first_token_of: dict[str, list[float]] = {m: [] for m in MODES}
    ttft: dict[str, list[float]] = {m: [] for m in MODES}
    blocks_reused = store_hit_tokens = 0
    for i, user in enumerate(users):
        prompt = system + user
        for mode in MODES:
            eng, rid = engines[mode], f"{mode}-{i}"
            start = time.perf_counter()
            if mode == "store":
                token, num_blocks = await via_store(eng, store, rid, prompt, block_size)
                blocks_reused += num_blocks
            else:
                eng.add_request(rid, prompt, FIRST)
                token = first_token(eng, rid)
            ttft[mode].append(time.perf_counter() - start)
            first_token_of[mode].append(token)
            if mode == "store":  # next request must fetch again, as a worker with a cold pool would
                store_hit_tokens += eng.stats().num_cached_tokens  # what PREFIX_CACHE_HITS reports
                engines["store"] = engine(True)
    await transport.close()
    prompt_tokens = num_requests * (system_tokens + user_tokens)
    p50 = {m: statistics.median(v) for m, v in ttft.items()}
    return {
        "system_tokens": system_tokens,
        "user_tokens": user_tokens,
        "num_requests": num_requests,
        "cached_fraction": (system_tokens // block_size * block_size) / (system_tokens + user_tokens),
        "ttft_s": ttft,
        "ttft_p50_s": p50,
        "speedup_p50": {"store_vs_cold": p50["cold"] / p50["store"], "pool_vs_cold": p50["cold"] / p50["pool"]},
        "same_first_tokens": first_token_of["cold"] == first_token_of["store"] == first_token_of["pool"],
        "store_blocks_reused": blocks_reused,
        "store_reused_token_fraction": blocks_reused * block_size / prompt_tokens,
        "store_hit_rate_metric": store_hit_tokens / prompt_tokens,
        "pool_hit_rate_metric": (engines["pool"].stats().num_cached_tokens) / prompt_tokens,
    }

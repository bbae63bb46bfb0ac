"""An engine with a host tier: blocks evicted from its pool come back from host memory at admission
(no recompute, same tokens), prefetched blocks are used the same way, and events name the tier."""

from __future__ import annotations

import pytest

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams, hash_full_blocks

pytestmark = pytest.mark.unit

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
PROMPT = [(5 * i + 11) % 250 + 3 for i in range(64)] + [7]  # 4 full blocks of 16 + 1 token
OTHER = [(7 * i + 3) % 250 + 3 for i in range(64)] + [9]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    yield load_model(make_model(tmp_path_factory.mktemp("host-tier") / "tiny", "llama", "tiny"))


def run(eng: LLMEngine, request_id: str, prompt: list[int]) -> int:
    eng.add_request(request_id, prompt, FIRST_TOKEN)
    while True:
        for out in eng.step():
            if out.request_id == request_id:
                return out.new_token_ids[0]


def small_engine(lm, host_blocks: int) -> LLMEngine:
    # 6 blocks: one 5-block prompt at a time, so OTHER evicts PROMPT's blocks
    return LLMEngine(lm, EngineConfig(num_kv_blocks=6, max_num_seqs=2, host_cache_blocks=host_blocks))


def test_evicted_blocks_come_back_from_the_host_instead_of_being_recomputed(lm):
    eng = small_engine(lm, host_blocks=16)
    expected = run(eng, "a", PROMPT)
    hashes = hash_full_blocks(PROMPT, 16)
    run(eng, "b", OTHER)
    device, host = eng.cached_tiers(hashes)
    assert device < 4 and device + host == 4  # pushed out of the pool, kept on the host
    computed = eng.stats().num_computed_tokens
    assert run(eng, "c", PROMPT) == expected
    stats = eng.stats()
    assert stats.num_computed_tokens - computed == 1  # only the last token: 4 blocks from pool + host
    assert stats.num_host_hit_blocks == host


def test_without_a_host_tier_evicted_blocks_are_recomputed(lm):
    eng = small_engine(lm, host_blocks=0)
    expected = run(eng, "a", PROMPT)
    run(eng, "b", OTHER)
    computed = eng.stats().num_computed_tokens
    assert run(eng, "c", PROMPT) == expected
    assert eng.stats().num_computed_tokens - computed > 16


def test_prefetched_blocks_are_admitted_from_the_host(lm):
    source = LLMEngine(lm, EngineConfig(num_kv_blocks=32, role="prefill"))
    source.add_request("a", PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while not source.step():
        pass
    expected = source._pinned["a"].seq.output_token_ids[0]
    kv = source.take_prefilled("a")

    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=32, host_cache_blocks=8))
    hashes = hash_full_blocks(PROMPT, 16)
    assert eng.prefetch_to_host(hashes, kv.data[:4]) == 4
    assert eng.prefetch_to_host(hashes, kv.data[:4]) == 0  # already there
    assert eng.cached_tiers(hashes) == (0, 4)
    assert eng.drain_host_events() == (hashes, [])
    assert run(eng, "b", PROMPT) == expected
    assert eng.stats().num_computed_tokens == 1
    assert eng.cached_tiers(hashes) == (4, 0)  # promoted into the pool
    stored, _ = eng.drain_kv_events()
    assert set(hashes) <= set(stored)


def test_host_tier_is_off_by_default(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=8))
    assert eng.host is None and eng.drain_host_events() == ([], [])
    assert eng.prefetch_to_host([], None) == 0


def test_a_finished_sequences_blocks_after_its_prompt_can_be_taken(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=32))
    eng.remember_finished(4)
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    tokens = list(PROMPT)
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.new_token_ids
    hashes, copy = eng.take_finished_kv("a", skip_blocks=4)
    assert hashes == hash_full_blocks(tokens[:-1], 16)[4:]  # 104 computed tokens: blocks 4..5
    assert copy.wait().shape[0] == len(hashes) == 2
    assert eng.take_finished_kv("a") is None  # taken once

"""Exactness of partial-block reuse in the engine: a turn that extends the previous turn's tokens gets
its partial last block copied (from the pool, or from the host tier where the previous turn's worker
wrote it back) and computes only the rest, with greedy tokens identical to computing everything."""

from __future__ import annotations

import pytest

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams, hash_full_blocks, hash_partial_block

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [(5 * i + 11) % 250 + 3 for i in range(37)]  # + 8 answer tokens: 44 computed = 2 blocks + 12
MESSAGE = [(7 * i + 3) % 250 + 3 for i in range(9)]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    yield load_model(make_model(tmp_path_factory.mktemp("partial") / "tiny", "llama", "tiny"))


def generate(eng: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    eng.add_request(request_id, prompt, GREEDY)
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def turns(lm):
    """(turn 1's answer, turn 2's prompt, turn 2's answer computed from scratch without any cache)."""
    ref = LLMEngine(lm, EngineConfig(num_kv_blocks=32, enable_prefix_caching=False))
    answer = generate(ref, "t1", PROMPT)
    second = PROMPT + answer + MESSAGE
    return answer, second, generate(ref, "t2", second)


def test_the_next_turn_copies_the_partial_block_and_computes_only_the_rest(lm, turns):
    answer, second, expected = turns
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=32))
    assert generate(eng, "t1", PROMPT) == answer
    computed = eng.stats().num_computed_tokens
    assert generate(eng, "t2", second) == expected
    stats = eng.stats()
    assert stats.num_partial_hit_tokens == 12  # the answer's last 12 computed tokens: not recomputed
    assert stats.num_computed_tokens - computed == len(second) - 44 + len(expected) - 1


def test_a_partial_block_written_back_elsewhere_comes_through_the_host_tier(lm, turns):
    answer, second, expected = turns
    first = LLMEngine(lm, EngineConfig(num_kv_blocks=32))  # the previous turn's (decode) worker
    first.remember_finished(4)
    assert generate(first, "t1", PROMPT) == answer
    taken = first.take_finished_chain("t1")
    assert taken is not None
    chain, copy, partial = taken
    tokens = PROMPT + answer
    assert chain == hash_full_blocks(tokens, 16)[:2]
    assert partial == hash_partial_block(chain[1], tokens[32:44])
    data = copy.wait()
    assert data.shape[0] == 3

    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=32, host_cache_blocks=8))  # the next turn's worker
    assert eng.prefetch_to_host(chain + [partial], data) == 3
    assert generate(eng, "t2", second) == expected
    stats = eng.stats()
    assert stats.num_partial_hit_tokens == 12 and stats.num_host_hit_blocks == 3
    assert stats.num_computed_tokens == len(second) - 44 + len(expected) - 1


def test_without_the_partial_block_the_tail_is_computed_with_the_same_tokens(lm, turns):
    _, second, expected = turns
    first = LLMEngine(lm, EngineConfig(num_kv_blocks=32))
    first.remember_finished(4)
    generate(first, "t1", PROMPT)
    chain, copy, _ = first.take_finished_chain("t1")
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=32, host_cache_blocks=8))
    eng.prefetch_to_host(chain, copy.wait()[:2])  # full blocks only: what was written back before
    assert generate(eng, "t2", second) == expected
    stats = eng.stats()
    assert stats.num_partial_hit_tokens == 0
    assert stats.num_computed_tokens == len(second) - 32 + len(expected) - 1

"""An engine admits a request with an externally supplied KV prefix (the store's blocks): only
the suffix is computed, the prefix counts as cached, and it joins the pool's prefix cache."""

from __future__ import annotations

import pytest

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams, hash_full_blocks

pytestmark = pytest.mark.unit

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
PREFIX = [(5 * i + 11) % 250 + 3 for i in range(64)]  # 4 blocks of 16
PROMPT = PREFIX + list(range(20, 33))


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    yield load_model(make_model(tmp_path_factory.mktemp("prefix-kv") / "tiny", "llama", "tiny"))


def first_token(eng: LLMEngine, request_id: str) -> int:
    while True:
        for out in eng.step():
            if out.request_id == request_id:
                return out.new_token_ids[0]


def test_external_prefix_computes_only_the_suffix_and_is_reused_locally(lm):
    source = LLMEngine(lm, EngineConfig(num_kv_blocks=32, role="prefill"))
    source.add_request("a", PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    expected = first_token(source, "a")
    kv = source.take_prefilled("a")

    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=32))
    hashes = hash_full_blocks(PROMPT, 16)
    assert eng.num_cached_blocks(hashes) == 0
    eng.add_prefilled("b", PROMPT, [], FIRST_TOKEN, kv.data[:4], len(PREFIX), count_as_cached=True)
    assert first_token(eng, "b") == expected
    stats = eng.stats()
    assert (stats.num_cached_tokens, stats.num_computed_tokens) == (len(PREFIX), len(PROMPT) - len(PREFIX))
    assert eng.num_cached_blocks(hashes) == 4  # the prefix blocks (the 5th is partial) are in the pool's cache
    stored, _ = eng.drain_kv_events()
    assert stored[:4] == hashes[:4]

    eng.add_request("c", PROMPT, FIRST_TOKEN)  # a later local request hits the same blocks
    assert first_token(eng, "c") == expected
    assert eng.stats().num_cached_tokens == 2 * len(PREFIX)


def test_a_handoff_prefix_is_not_counted_as_cached(lm):
    source = LLMEngine(lm, EngineConfig(num_kv_blocks=32, role="prefill"))
    source.add_request("a", PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    first_token(source, "a")
    kv = source.take_prefilled("a")
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=32))
    eng.add_prefilled("b", PROMPT, [], FIRST_TOKEN, kv.data[:4], len(PREFIX))
    first_token(eng, "b")
    assert eng.stats().num_cached_tokens == 0

"""KvCopier on the CPU, the code path a GPU shares: a copy out captures the blocks before a later step
reuses their slots, blocks staged on another thread (as the I/O side stages fetched ones) decode
token-identically, neither direction reads a device value back on the host (on a GPU that would
wait for the running step), and bad block ids are refused before anything is queued."""

from __future__ import annotations

import threading

import pytest
import torch
from host_sync import watch_host_syncs

from ferry.engine.config import EngineConfig
from ferry.engine.kv_copy import InCopy, KvCopier
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.kv_cache import PagedKVCache
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit

FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [(5 * i + 11) % 250 + 3 for i in range(40)]
OTHER = [(7 * i + 3) % 250 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_model(tmp_path_factory.mktemp("kv-copy") / "tiny", "llama", "tiny"))


def run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def prefilled(lm, request_id: str, prompt: list[int], num_kv_blocks: int = 64) -> tuple[LLMEngine, list[int]]:
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=num_kv_blocks, role="prefill", enable_prefix_caching=False))
    eng.add_request(request_id, prompt, GREEDY)
    first = run_to_end(eng)[request_id]
    return eng, first


def test_a_copy_out_holds_the_blocks_as_they_were_when_taken_though_a_later_step_reuses_the_slots(lm):
    eng, _ = prefilled(lm, "a", PROMPT, num_kv_blocks=3)  # 40 tokens: 3 blocks, the whole pool
    block_ids = eng._pinned["a"].seq.block_ids[:3]
    before = eng.runner.kv.read_blocks(block_ids)
    kv = eng.take_prefilled("a")  # the copy is under way, the slots are free
    eng.add_request("b", OTHER, FIRST)
    run_to_end(eng)  # b's prefill writes into the same 3 slots
    assert not torch.equal(eng.runner.kv.read_blocks(block_ids), before), "the slots were not reused"
    assert kv.copy.done()
    assert torch.equal(kv.data, before)


def test_blocks_staged_on_another_thread_decode_the_same_tokens_as_one_engine(lm):
    whole = LLMEngine(lm, EngineConfig(num_kv_blocks=64))
    whole.add_request("a", PROMPT, GREEDY)
    expected = run_to_end(whole)["a"]

    source, first = prefilled(lm, "a", PROMPT)
    kv = source.take_prefilled("a")
    target = LLMEngine(lm, EngineConfig(num_kv_blocks=64))
    staged: list[InCopy] = []
    io_thread = threading.Thread(target=lambda: staged.append(target.stage_kv(kv.data)))
    io_thread.start()
    io_thread.join()
    target.add_prefilled("a", PROMPT, first, GREEDY, staged[0], kv.num_tokens)
    assert first + run_to_end(target)["a"] == expected


def test_copies_in_both_directions_read_nothing_back_from_the_device():
    kv = PagedKVCache(2, 2, 8, 4, 2, 8, "cpu", torch.float32)
    kv.data.normal_()
    copier = KvCopier(kv)
    with watch_host_syncs() as found:
        copy = copier.copy_out([5, 1, 6])
        copier.write([0, 2, 3], copier.stage(torch.randn(3, *kv.block_shape)))
    assert found == []
    with watch_host_syncs() as found:
        kv.read_blocks([5, 1, 6])  # what the engine used before: it checks the ids on the device
    assert found, "the detector sees the old path's device read"
    assert torch.equal(copy.wait(), kv.data[:, :, :, [5, 1, 6]].permute(3, 0, 1, 2, 4, 5))


def test_host_blocks_written_one_by_one_land_in_their_slots():
    kv = PagedKVCache(1, 2, 6, 4, 1, 8, "cpu", torch.bfloat16)
    copier = KvCopier(kv)
    blocks = [torch.randn(*kv.block_shape) for _ in range(2)]  # fp32 in, the cache's dtype stored
    copier.write([4, 1], blocks)
    assert torch.equal(copier.copy_out([4, 1]).wait(), torch.stack(blocks).to(torch.bfloat16))


def test_bad_block_ids_and_shapes_are_refused():
    kv = PagedKVCache(1, 2, 4, 4, 1, 8, "cpu", torch.float32)
    copier = KvCopier(kv)
    with pytest.raises(ValueError, match=r"out of range 0\.\.3"):
        copier.copy_out([0, 4])
    with pytest.raises(ValueError, match="out of range"):
        copier.write([-1], torch.zeros(1, *kv.block_shape))
    with pytest.raises(ValueError, match="shape"):
        copier.write([0, 1], torch.zeros(1, *kv.block_shape))

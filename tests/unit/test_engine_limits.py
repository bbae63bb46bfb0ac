"""Engine limits changed between steps (the SLO controller's lever) and the per-step record."""

import pytest
import torch

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(make_model(tmp_path_factory.mktemp("limits") / "tiny", "llama", "tiny"))
    torch.set_num_threads(threads)


def add(eng, n, prompt_len=20):
    for i in range(n):
        eng.add_request(f"r{i}", [5 + (i + j) % 200 for j in range(prompt_len)], GREEDY)


def test_a_lower_cap_admits_fewer_and_a_higher_one_more(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=256, max_num_seqs=8))
    add(eng, 8)
    eng.set_limits(max_num_seqs=3)
    eng.step()
    assert eng.stats().num_running == 3 and eng.max_num_seqs == 3
    assert eng.config.max_num_seqs == 8  # the configured (fixed) cap is kept
    eng.set_limits(max_num_seqs=6)
    eng.step()
    assert eng.stats().num_running == 6
    eng.set_limits(max_num_seqs=2)  # below what runs: nobody is preempted, nobody new admitted
    eng.step()
    assert eng.stats().num_running == 6 and eng.stats().num_preemptions == 0
    assert not eng.can_admit(10)


def test_a_smaller_token_budget_chunks_the_prefill(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=256))
    add(eng, 1, prompt_len=100)
    eng.set_limits(max_num_batched_tokens=32)
    eng.step()
    assert (eng.last_step.num_seqs, eng.last_step.num_prefill_tokens) == (1, 32)
    assert eng.last_step.num_context_tokens == 0
    eng.step()
    assert (eng.last_step.num_prefill_tokens, eng.last_step.num_context_tokens) == (32, 32)


def test_the_step_record_says_what_ran(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=256))
    assert eng.last_step is None
    add(eng, 3, prompt_len=20)
    eng.step()  # three whole prefills
    first = eng.last_step
    assert (first.num_seqs, first.num_prefill_tokens, first.num_context_tokens) == (3, 60, 0)
    assert first.duration_ms > 0
    eng.step()  # three decodes over 20 cached tokens each (the sampled token is the new one)
    assert (eng.last_step.num_seqs, eng.last_step.num_prefill_tokens, eng.last_step.num_context_tokens) == (3, 0, 60)


def test_bad_limits_name_the_field(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match="max_num_seqs"):
        eng.set_limits(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        eng.set_limits(max_num_batched_tokens=0)


def test_prefill_backlog_lists_prompts_not_prefilled_in_scheduling_order(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=256, max_num_seqs=2, max_num_batched_tokens=24))
    for i, when in enumerate((1.0, 2.0, 3.0)):
        eng.add_request(f"r{i}", [5 + 30 * i + j for j in range(20)], GREEDY, arrival_time=when)
    assert eng.prefill_backlog() == [(1.0, 20), (2.0, 20), (3.0, 20)]
    eng.step()  # r0 whole (20), r1's first 4 tokens; r2 waits for a slot
    assert eng.prefill_backlog() == [(2.0, 16), (3.0, 20)]
    assert eng.decode_load() == (1, 20)  # r0 decodes next over its 20 cached tokens


def test_the_queue_view_and_a_reordered_waiting_queue(lm):
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=256, max_num_seqs=1, max_num_batched_tokens=64))
    for i, when in enumerate((1.0, 2.0, 3.0)):
        eng.add_request(f"r{i}", [5 + 30 * i + j for j in range(20)], GREEDY, arrival_time=when)
    eng.step()  # r0 prefilled and sampled its first token; r1, r2 wait for the one slot
    assert eng.running_decodes() == [("r0", 20, 1, 5)]
    assert eng.prompts() == [("r1", 2.0, 20, 6), ("r2", 3.0, 20, 6)] and eng.prompts(waiting=False) == []
    eng.reorder_waiting(["r2"])  # the listed first, the rest behind in their order
    assert [rid for rid, *_ in eng.prompts()] == ["r2", "r1"]
    while eng.running_decodes():
        eng.step()
    eng.step()  # r0 finished: r2 is admitted before r1
    assert [rid for rid, *_ in eng.prompts()] == ["r1"]

"""Expert parallelism changes where experts run, never what the model says: greedy tokens of a
batch of mixed-length prompts (chunked prefill, sequences of different lengths) on the tiny
DeepSeek-V3 checkpoint are identical to the single-process engine's for EP sizes 1, 2 and 4, with
a placement that keeps redundant copies of experts, with EPLB re-placing experts mid-generation,
and with each step run as two micro-batches (one after the other, or overlapped). The ranks are
spawned processes on gloo."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ferry.engine.config import EngineConfig
from ferry.engine.generate_cli import generate
from ferry.engine.llm_engine import LLMEngine
from ferry.model.make_model import make_model
from ferry.parallel.eplb import EplbConfig
from ferry.parallel.group_generate import GroupFailed, generate_on_group, start_group
from ferry.parallel.placement import ExpertPlacement
from ferry.protocol import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # spawns 8 rank processes in all

CONFIG = EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(1 + 6 * i)]} for i in range(6)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("ep") / "ds", "deepseek-v3", "tiny", seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return [r["token_ids"] for r in generate(LLMEngine.from_model_path(checkpoint, CONFIG), PROMPTS, GREEDY)]


@pytest.mark.parametrize(("ep_size", "mode"), [(1, "single"), (2, "single"), (4, "overlap")])
def test_greedy_tokens_match_single_process(checkpoint, reference, ep_size, mode):
    run = generate_on_group(checkpoint, PROMPTS, GREEDY, CONFIG, ep_size, mode=mode)
    assert [r["token_ids"] for r in run.results] == reference
    assert all(len(tokens) == GREEDY.max_tokens for tokens in reference)
    assert [r.num_requests for r in run.ranks] == [len(PROMPTS[r::ep_size]) for r in range(ep_size)]


def test_redundant_copies_of_experts_match_too(checkpoint, reference):
    # 8 experts over 2 ranks x 6 slots: experts 0, 1, 4, 5 have a copy on each rank
    placement = ExpertPlacement(8, ((0, 1, 2, 3, 4, 5), (4, 5, 6, 7, 0, 1)))
    run = generate_on_group(checkpoint, PROMPTS, GREEDY, CONFIG, 2, placement, mode="sequential")
    assert [r["token_ids"] for r in run.results] == reference


def test_eplb_re_placing_experts_between_steps_changes_no_token(checkpoint, reference):
    eplb = EplbConfig(every_steps=3, window_steps=4, redundant_slots_per_rank=2)
    run = generate_on_group(checkpoint, PROMPTS, GREEDY, CONFIG, 2, eplb=eplb, mode="overlap")
    assert [r["token_ids"] for r in run.results] == reference
    assert all(r.num_rebalances >= 3 for r in run.ranks)
    assert sum(r.num_experts_loaded for r in run.ranks) > 0  # experts really moved between ranks


def test_a_killed_rank_fails_the_whole_group_and_nothing_hangs(checkpoint):
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    config = EngineConfig(num_kv_blocks=2048, block_size=4, max_num_seqs=4)
    handle = start_group(checkpoint, PROMPTS[:4], long, config, 2)
    time.sleep(6)  # loading or generating: either way the group must fail, not wait for the dead rank
    os.kill(handle.pids[1], signal.SIGKILL)
    with pytest.raises(GroupFailed, match="rank 1 failed: process 1 terminated with signal SIGKILL"):
        handle.result(timeout_s=60)
    assert not any(p.is_alive() for p in handle.context.processes)

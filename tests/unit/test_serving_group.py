"""A serving worker's group of rank processes seen as one engine (ferry.parallel.serving_group): it
deals sequences across its ranks, generates the single-process engine's greedy tokens, reports each
rank's load, and a rank that dies is noticed at once and fails every later call. gloo, 2 ranks."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from ferry.engine.config import EngineConfig
from ferry.engine.generate_cli import generate
from ferry.engine.llm_engine import LLMEngine
from ferry.model.make_model import make_model
from ferry.parallel.group_generate import GroupFailed
from ferry.parallel.serving_group import GroupEngine
from ferry.protocol import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # spawns a rank process

CONFIG = EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, host_cache_blocks=0)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(1 + 5 * i)]} for i in range(5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("group") / "ds", "deepseek-v3", "tiny", seed=3)


def test_a_group_generates_what_one_process_does_and_deals_to_every_rank(checkpoint):
    reference = [r["token_ids"] for r in generate(LLMEngine.from_model_path(checkpoint, CONFIG), PROMPTS, GREEDY)]
    group = GroupEngine.start(checkpoint, CONFIG, 2)
    try:
        group.warmup()
        assert group.max_num_seqs == 2 * CONFIG.max_num_seqs
        assert [r["token_ids"] for r in generate(group, PROMPTS, GREEDY)] == reference
        assert sorted(set(group.owner.values())) == [0, 1]  # both ranks held sequences
        assert [s.num_generated_tokens for s in group.rank_stats] == [
            GREEDY.max_tokens * list(group.owner.values()).count(r) for r in (0, 1)
        ]
        assert group.stats().num_generated_tokens == GREEDY.max_tokens * len(PROMPTS)
        assert not group.has_unfinished_requests()
    finally:
        group.close()
    assert not any(link.process.is_alive() for link in group.links)


def test_a_dead_rank_is_noticed_at_once_and_fails_the_next_call(checkpoint):
    group = GroupEngine.start(checkpoint, CONFIG, 2)
    failed = threading.Event()
    reasons: list[str] = []
    group.watch(lambda reason: (reasons.append(reason), failed.set()))
    os.kill(group.pids[1], signal.SIGKILL)
    assert failed.wait(10)
    assert reasons[0].startswith("rank 1 ") and "exited with -9" in reasons[0]
    with pytest.raises(GroupFailed, match="rank 1 is gone"):
        group.add_request("x", [5, 6, 7], GREEDY)
        group.step()
    group.close()


@pytest.mark.parametrize("weights_dtype", ["int8", "int4"])
def test_quantized_weights_are_refused_before_any_rank_starts_naming_both_settings(checkpoint, weights_dtype):
    import dataclasses

    import torch.multiprocessing as mp

    config = dataclasses.replace(CONFIG, weights_dtype=weights_dtype)
    before = len(mp.active_children())
    with pytest.raises(ValueError) as refused:
        GroupEngine.start(checkpoint, config, 2)
    message = str(refused.value)
    assert all(name in message for name in (weights_dtype, "FERRY_WEIGHTS_DTYPE", "FERRY_EP_SIZE"))
    assert len(mp.active_children()) == before  # refused at start: no rank was spawned

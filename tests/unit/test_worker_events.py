"""The worker's pure helpers: token events batched per gateway, hand-off block lists, recent ids."""

from dataclasses import dataclass

import pytest

from ferry.protocol import PARTIAL_BLOCK_KEY, GenerateRequest, SamplingParams, hash_block, hash_full_blocks
from ferry_services.worker.events import batch_by_gateway, handoff_blocks
from ferry_services.worker.recent import RecentIds

pytestmark = pytest.mark.unit


def request(request_id: str, gateway_id: str, attempt: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id, gateway_id, "m", [1, 2, 3], SamplingParams(), attempt=attempt)


@dataclass
class Out:
    request_id: str
    index: int
    new_token_ids: list
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 3


def test_one_batch_per_gateway_per_step_and_untracked_requests_dropped():
    outputs = [
        Out("a@0", 0, [5], "x"),
        Out("b@0", 2, [6]),
        Out("c@2", 1, [7], finish_reason="length"),
        Out("gone@0", 0, [1]),
    ]
    held = {f"{r.request_id}@{r.attempt}": r for r in (request("a", "g1"), request("b", "g2"), request("c", "g1", 2))}
    batches = batch_by_gateway(outputs, held.get, "w1")
    assert sorted(batches) == ["g1", "g2"]
    assert [(e.request_id, e.attempt, e.index, e.token_ids, e.text) for e in batches["g1"].tokens] == [
        ("a", 0, 0, [5], "x"),
        ("c", 2, 1, [7], ""),
    ]
    assert batches["g1"].tokens[1].finish_reason == "length"
    assert batches["g2"].worker_id == "w1" and batches["g2"].tokens[0].num_prompt_tokens == 3


def test_handoff_blocks_keep_prefix_hashes_and_key_the_partial_tail():
    tokens = list(range(40))
    full = hash_full_blocks(tokens, 16)
    hashes, refs = handoff_blocks(tokens, 40, 16, full)
    assert hashes[:2] == full
    assert hashes[2] == hash_block(full[1], tokens[32:40], [PARTIAL_BLOCK_KEY])
    assert [r.num_tokens for r in refs] == [16, 16, 8] and [r.block_hash for r in refs] == hashes


def test_handoff_blocks_of_exact_and_short_sequences():
    tokens = list(range(32))
    hashes, refs = handoff_blocks(tokens, 32, 16, hash_full_blocks(tokens, 16))
    assert len(hashes) == 2 and sum(r.num_tokens for r in refs) == 32
    hashes, refs = handoff_blocks([1, 2, 3], 3, 16, [])
    assert hashes == [hash_block(None, [1, 2, 3], [PARTIAL_BLOCK_KEY])] and refs[0].num_tokens == 3


def test_handoff_blocks_need_every_full_hash():
    with pytest.raises(ValueError, match="full_hashes"):
        handoff_blocks(list(range(40)), 40, 16, [bytes(16)])


def test_recent_ids_forget_the_oldest_first():
    recent = RecentIds(capacity=2)
    for rid in ("a", "b", "a", "c"):
        recent.add(rid)
    assert ("a" in recent, "b" in recent, "c" in recent, len(recent)) == (True, False, True, 2)
    with pytest.raises(ValueError, match="capacity"):
        RecentIds(0)

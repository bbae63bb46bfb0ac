"""The classic (padded) static baseline: a batch forms when the server is idle, every member decodes
to the batch's longest output, and nobody joins until it is done."""

import pytest
import torch

from ferry.bench.offline import OfflineConfig, run_offline
from ferry.bench.offline_turns import engine_turns, side_by_side, static_batch
from ferry.bench.workload import WorkloadConfig, WorkloadRequest, make_workload
from ferry.engine.config import EngineConfig
from ferry.model import load_model
from ferry.model.make_model import make_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", "tiny")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_static_batch_takes_the_queue_head_padded_to_its_longest():
    reqs = [WorkloadRequest(i, [16] * 20, n) for i, n in enumerate([2, 9, 4, 3, 5])]
    batch = static_batch(reqs, EngineConfig(max_num_seqs=2, num_kv_blocks=64, block_size=16))
    assert [(r.index, r.max_tokens) for r in batch] == [(0, 9), (1, 9)]
    assert [r.max_tokens for r in reqs] == [2, 9, 4, 3, 5]  # the queue's own requests are untouched


def test_static_batch_left_pads_prompts_to_the_longest_as_a_dense_server_does():
    reqs = [WorkloadRequest(0, [7] * 5, 3), WorkloadRequest(1, [9] * 2, 4)]
    batch = static_batch(reqs, EngineConfig(max_num_seqs=2, num_kv_blocks=64, block_size=16))
    assert [r.prompt_token_ids for r in batch] == [[7] * 5, [0] * 3 + [9] * 2]
    assert [r.max_tokens for r in batch] == [4, 4]


def test_static_batch_stops_where_the_padded_batch_outgrows_the_pool():
    # 20-token prompts: alone 20+9 tokens = 2 blocks; padded to 30 outputs each member needs 4 blocks
    reqs = [
        WorkloadRequest(0, [16] * 20, 9),
        WorkloadRequest(1, [16] * 20, 9),
        WorkloadRequest(2, [16] * 20, 30),
        WorkloadRequest(3, [16] * 20, 1),
    ]
    batch = static_batch(reqs, EngineConfig(max_num_seqs=4, num_kv_blocks=8, block_size=16))
    assert [r.index for r in batch] == [0, 1]  # request 2 would pad everyone to 50 tokens: 12 blocks
    with pytest.raises(ValueError, match="request 2 needs 4 KV blocks > num_kv_blocks=3"):
        static_batch(reqs[2:], EngineConfig(max_num_seqs=4, num_kv_blocks=3, block_size=16))


def test_online_padded_server_makes_late_arrivals_wait_for_the_whole_batch(tiny, one_thread):
    lm = load_model(tiny)
    reqs = [WorkloadRequest(i, list(range(20 + i, 40 + i)), n) for i, n in enumerate([2, 8, 3, 5, 4])]
    arrivals = [0.0, 0.0, 1e-6, 1e-6, 1000.0]  # 2 and 3 arrive while the first batch runs
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=256)
    runs = side_by_side(
        {name: engine_turns(lm, config, reqs, arrivals, name) for name in ("static_padded", "dynamic")},
        10,
        progress=False,
    )
    padded, dynamic = runs["static_padded"], runs["dynamic"]
    assert padded.static_batches == [[0, 1], [2, 3], [4]]  # cap 4, yet 2 and 3 did not join batch 1
    assert dynamic.static_batches == []
    # padded tokens are computed: every prompt, then each member decodes to its batch's longest - 1
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    assert padded.engine_stats["num_computed_tokens"] == prompt_tokens + 2 * 7 + 2 * 4 + 3
    assert dynamic.engine_stats["num_computed_tokens"] == prompt_tokens + sum(n - 1 for n in (2, 8, 3, 5, 4))
    assert padded.output_tokens == dynamic.output_tokens == 22  # but only wanted tokens count as output
    e2e = dict(zip(padded.request_indices, padded.e2e_s))
    ttft = dict(zip(padded.request_indices, padded.ttft_s))
    assert min(ttft[2], ttft[3]) >= e2e[1] - 1e-6  # their first token comes after batch 1 is done


def test_offline_padded_static_computes_the_padding_but_reports_wanted_tokens(tiny, tmp_path):
    cfg = OfflineConfig(
        model=tiny,
        out_dir=tmp_path / "out",
        systems=("static", "static_padded"),
        workload=WorkloadConfig(num_requests=4, vocab_size=512, output_lens=(2, 8), seed=1),
        max_num_seqs=2,
        num_kv_blocks=256,
        rate_fractions=(),
        threads=1,
        show_progress=False,
    )
    threads = torch.get_num_threads()
    try:
        report = run_offline(cfg)
    finally:
        torch.set_num_threads(threads)
    compact, padded = report["offline"]["static"], report["offline"]["static_padded"]
    assert padded["output_tokens"] == compact["output_tokens"] and padded["num_requests"] == 4
    reqs = make_workload(cfg.workload)
    extra = sum(max(r.max_tokens for r in pair) * 2 - sum(r.max_tokens for r in pair) for pair in (reqs[:2], reqs[2:]))
    assert extra > 0  # the seeded workload mixes lengths inside a batch
    prompt_pad = sum(
        max(len(r.prompt_token_ids) for r in pair) * 2 - sum(len(r.prompt_token_ids) for r in pair)
        for pair in (reqs[:2], reqs[2:])
    )
    assert prompt_pad > 0
    extra += prompt_pad
    assert padded["engine"]["num_computed_tokens"] - compact["engine"]["num_computed_tokens"] == extra
    assert padded["num_static_batches"] == 2 and report["labels"]["static_padded"] == "static (padded)"

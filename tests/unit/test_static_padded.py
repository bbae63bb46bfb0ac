"""The classic (padded) static baseline: finished slots keep decoding until the batch's longest is done."""

import pytest
import torch

from ferry.bench.offline import OfflineConfig, padded_requests, run_offline
from ferry.bench.workload import WorkloadConfig, WorkloadRequest, make_workload
from ferry.engine.config import EngineConfig
from ferry.model.make_model import make_model

pytestmark = pytest.mark.unit


def test_padded_requests_take_their_batch_longest_output():
    reqs = [WorkloadRequest(i, [16] * 20, n) for i, n in enumerate([2, 9, 4, 3, 5])]
    config = EngineConfig(max_num_seqs=2, num_kv_blocks=64, block_size=16)
    assert [r.max_tokens for r in padded_requests(reqs, [0.0] * 5, config)] == [9, 9, 4, 4, 5]
    with pytest.raises(ValueError, match="arrive at once"):
        padded_requests(reqs, [0.0, 1.0, 1.0, 1.0, 1.0], config)
    with pytest.raises(ValueError, match="KV blocks"):
        padded_requests(reqs, [0.0] * 5, EngineConfig(max_num_seqs=2, num_kv_blocks=3, block_size=16))


def test_padded_static_computes_the_padding_but_reports_wanted_tokens(tmp_path):
    threads = torch.get_num_threads()
    model = make_model(tmp_path / "tiny", "llama", "tiny")
    cfg = OfflineConfig(model=model, out_dir=tmp_path / "out", systems=("static", "static_padded"),
                        workload=WorkloadConfig(num_requests=4, vocab_size=512, output_lens=(2, 8), seed=1),
                        max_num_seqs=2, num_kv_blocks=256, rate_fractions=(), threads=1, show_progress=False)
    try:
        report = run_offline(cfg)
    finally:
        torch.set_num_threads(threads)
    compact, padded = report["offline"]["static"], report["offline"]["static_padded"]
    assert padded["output_tokens"] == compact["output_tokens"] and padded["num_requests"] == 4
    reqs = make_workload(cfg.workload)
    extra = sum(p.max_tokens - r.max_tokens for p, r in zip(padded_requests(reqs, [0.0] * 4, EngineConfig(
        max_num_seqs=2, num_kv_blocks=256)), reqs))
    assert extra > 0  # the seeded workload mixes lengths inside a batch
    assert padded["engine"]["num_computed_tokens"] - compact["engine"]["num_computed_tokens"] == extra
    assert report["labels"]["static_padded"] == "static (padded)"

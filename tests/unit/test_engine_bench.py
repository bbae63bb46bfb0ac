"""The engine benchmark's pieces: the seeded workload, and one small offline run end to end."""

import json
import statistics

import pytest
import torch

from ferry.bench.offline import OfflineConfig, run_offline
from ferry.bench.workload import WorkloadConfig, make_workload, poisson_arrivals
from ferry.model.make_model import make_model

pytestmark = pytest.mark.unit
SMALL_PROMPTS = WorkloadConfig(
    num_requests=6, vocab_size=512, output_lens=(2, 6), prompt_len_median=24, max_prompt_len=64
)


def test_workload_is_seeded_and_follows_benchmarks_md():
    cfg = WorkloadConfig(num_requests=400, seed=3)
    a, b = make_workload(cfg), make_workload(cfg)
    assert [(r.prompt_token_ids, r.max_tokens) for r in a] == [(r.prompt_token_ids, r.max_tokens) for r in b]
    assert make_workload(WorkloadConfig(num_requests=400, seed=4))[0].prompt_token_ids != a[0].prompt_token_ids
    lengths = [len(r.prompt_token_ids) for r in a]
    assert 16 <= min(lengths) and max(lengths) <= 1024 and 80 <= statistics.median(lengths) <= 125
    assert {r.max_tokens for r in a} == {16, 32, 64, 128, 256}
    assert all(16 <= t < 2048 for r in a for t in r.prompt_token_ids)


def test_shared_prefix_variant():
    reqs = make_workload(WorkloadConfig(num_requests=20, shared_prefix_len=300))
    assert all(r.prompt_token_ids[:300] == reqs[0].prompt_token_ids[:300] for r in reqs)
    assert all(len(r.prompt_token_ids) > 300 for r in reqs)


def test_poisson_arrivals_have_the_asked_rate():
    arrivals = poisson_arrivals(2000, 4.0, seed=1)
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 3.6 < (len(arrivals) - 1) / arrivals[-1] < 4.4
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate_rps"):
        poisson_arrivals(3, 0.0)


def test_small_offline_bench_writes_report_and_plots(tmp_path):
    threads = torch.get_num_threads()
    model = make_model(tmp_path / "tiny", "llama", "tiny")
    systems = ("dynamic", "static", "static_padded")
    cfg = OfflineConfig(
        model=model,
        out_dir=tmp_path / "out",
        systems=systems,
        workload=SMALL_PROMPTS,
        max_num_seqs=2,
        num_kv_blocks=256,
        rate_fractions=(1.0,),
        online_requests=4,
        kv_budget_tokens=160,
        kv_budget_max_num_seqs=8,
        threads=1,
        show_progress=False,
    )
    try:
        report = run_offline(cfg)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (
        saved["ratios"].keys()
        == report["ratios"].keys()
        >= {
            "dynamic_vs_static_output_tokens_per_s",
            "dynamic_vs_static_padded_output_tokens_per_s",
            "moderate_rate_p99_e2e_reduction_vs_static",
            "moderate_rate_p99_e2e_reduction_vs_static_padded",
        }
    )
    for system in systems:
        summary = saved["offline"][system]
        assert summary["num_requests"] == 6 and summary["e2e_ms"]["count"] == 6
        assert summary["output_tokens"] == sum(r.max_tokens for r in make_workload(cfg.workload))
        assert saved["online"][0][system]["num_requests"] == 4
    assert saved["machine_matmul_gflops"] > 0 and saved["offline"]["dynamic"]["model_flops_utilization"] > 0
    assert all((tmp_path / "out" / name).stat().st_size > 0 for name in saved["plots"])


def test_online_rates_are_fractions_of_the_classic_static_capacity(tmp_path):
    threads = torch.get_num_threads()
    model = make_model(tmp_path / "tiny", "llama", "tiny")
    cfg = OfflineConfig(
        model=model,
        out_dir=tmp_path / "out",
        systems=("dynamic", "static", "static_padded"),
        workload=WorkloadConfig(num_requests=4, vocab_size=512, output_lens=(2, 6)),
        max_num_seqs=2,
        num_kv_blocks=256,
        rate_fractions=(0.5,),
        online_requests=4,
        threads=1,
        show_progress=False,
    )
    try:
        report = run_offline(cfg)
    finally:
        torch.set_num_threads(threads)
    row = report["online"][0]
    assert report["online_rate_basis"] == row["rate_basis"] == "static_padded"
    assert row["offered_rps"] == pytest.approx(0.5 * report["offline"]["static_padded"]["requests_per_s"])
    assert row["load_vs_own_capacity"]["static_padded"] == pytest.approx(0.5)
    assert row["p99_e2e_reduction_vs_static_padded"] == pytest.approx(
        1 - row["dynamic"]["e2e_ms"]["p99"] / row["static_padded"]["e2e_ms"]["p99"]
    )


def test_equal_kv_memory_table_is_its_own_labelled_section(tmp_path):
    threads = torch.get_num_threads()
    model = make_model(tmp_path / "tiny", "llama", "tiny")
    cfg = OfflineConfig(
        model=model,
        out_dir=tmp_path / "out",
        systems=("dynamic", "static", "transformers"),
        workload=SMALL_PROMPTS,
        max_num_seqs=2,
        num_kv_blocks=256,
        rate_fractions=(),
        kv_budget_tokens=160,
        kv_budget_max_num_seqs=8,
        threads=1,
        show_progress=False,
    )
    try:
        report = run_offline(cfg)
    finally:
        torch.set_num_threads(threads)
    equal = report["equal_kv_memory"]
    assert "equal KV memory" in equal["label"] and equal["kv_budget_tokens"] == 160 and equal["max_num_seqs"] == 8
    assert set(equal["offline"]) == {"dynamic", "static"}  # transformers has no paged pool to size
    assert all(s["engine"]["kv_blocks_total"] == 10 and s["num_requests"] == 6 for s in equal["offline"].values())
    assert report["offline"]["dynamic"]["engine"]["kv_blocks_total"] == 256  # the equal-cap table is unchanged
    assert "dynamic_vs_static_output_tokens_per_s" in equal["ratios"] and "equal_kv_memory.png" in report["plots"]

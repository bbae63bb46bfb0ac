"""Trace workloads: the seeded day-night load, public trace replay, and a small SLO bench end to end."""

import argparse
import json

import pytest
import torch

from ferry.bench.cli import DEFAULT_PEAK_LOAD, _peak_load, add_arguments
from ferry.bench.slo_bench import SloBenchConfig, load_trace, meets, per_request, run_slo_bench
from ferry.bench.slo_capacity import peak_window_rps
from ferry.bench.trace import (
    DOCUMENT,
    DayNightConfig,
    day_night_trace,
    rate_rps,
    read_trace_file,
    replay_trace,
)
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.slo import SloTargets

pytestmark = pytest.mark.unit


def test_day_night_is_seeded_and_follows_the_day():
    cfg = DayNightConfig(day_s=240.0, peak_rps=10.0, num_bursts=0, seed=5)
    reqs, arrivals, _ = day_night_trace(cfg)
    again, _, _ = day_night_trace(cfg)
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in again]
    assert arrivals == sorted(arrivals) and all(0 <= a < 240 for a in arrivals)
    night = sum(1 for a in arrivals if a < 20 or a >= 220)  # 40 s around midnight
    noon = sum(1 for a in arrivals if 100 <= a < 140)  # 40 s around noon
    assert noon > 3 * night
    morning = [r for r, a in zip(reqs, arrivals) if 70 <= a < 120]  # 07:00 - 12:00: documents
    evening = [r for r, a in zip(reqs, arrivals) if 140 <= a < 210]  # 14:00 - 21:00: chat
    mean = lambda rs: sum(len(r.prompt_token_ids) for r in rs) / len(rs)  # noqa: E731
    assert mean(morning) > 2.5 * mean(evening)
    assert {r.max_tokens for r in morning} >= set(DOCUMENT.output_lens)


def test_bursts_raise_the_rate():
    cfg = DayNightConfig(day_s=100.0, num_bursts=2, burst_factor=3.0, burst_s=5.0)
    _, _, bursts = day_night_trace(cfg)
    assert len(bursts) == 2
    t = bursts[0] + 1.0
    assert rate_rps(cfg, t, bursts) == pytest.approx(3.0 * rate_rps(cfg, t, []))


def test_mooncake_and_azure_traces_replay(tmp_path):
    mooncake = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 2000, "input_length": 600, "output_length": 10, "hash_ids": [7, 8]},
        {"timestamp": 0, "input_length": 520, "output_length": 5000, "hash_ids": [7, 9]},
    ]
    mooncake.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records = read_trace_file(mooncake)
    assert [r.time_s for r in records] == [0.0, 2.0]
    reqs, arrivals = replay_trace(records, speedup=2.0, max_prompt_len=800, max_output_len=64, vocab_size=512)
    assert arrivals == [0.0, 1.0]
    assert [len(r.prompt_token_ids) for r in reqs] == [520, 600] and [r.max_tokens for r in reqs] == [64, 10]
    assert reqs[0].prompt_token_ids[:512] == reqs[1].prompt_token_ids[:512]  # shared block 7
    assert reqs[0].prompt_token_ids[512:520] != reqs[1].prompt_token_ids[512:520]

    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    records = read_trace_file(azure)
    assert records[1].time_s == pytest.approx(4.3146, abs=1e-3)
    assert (records[0].num_prompt_tokens, records[0].num_output_tokens) == (374, 44)


def test_the_public_mooncake_trace_lines_replay_with_their_shared_first_block(tmp_path):
    # the first lines of kvcache-ai/Mooncake's mooncake_trace.jsonl: every 512-token block of a
    # prompt has an id, a new id is the next integer, the shared id 0 is a common prefix
    lines = (
        '{"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,'
        " 11, 12, 13]}\n"
        '{"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, 14, 15, 16, 17, 18, 19, 20,'
        " 21, 22, 23, 24, 25, 26, 27]}\n"
        '{"timestamp": 3052, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}\n'
    )
    trace = tmp_path / "mooncake_trace.jsonl"
    trace.write_text(lines)
    records = read_trace_file(trace)
    assert [r.time_s for r in records] == [0.0, 0.0, 3.052] and len(records[0].block_ids) == 14
    reqs, arrivals = replay_trace(records, speedup=1.0, max_prompt_len=1024, max_output_len=256, vocab_size=2048)
    assert arrivals == [0.0, 0.0, 3.052]
    assert [len(r.prompt_token_ids) for r in reqs] == [1024] * 3 and [r.max_tokens for r in reqs] == [256] * 3
    prefixes = [r.prompt_token_ids[:512] for r in reqs]
    assert prefixes[0] == prefixes[1] == prefixes[2]  # block 0
    assert len({tuple(r.prompt_token_ids[512:]) for r in reqs}) == 3  # blocks 1, 14, 42


def test_a_bad_trace_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace_file(bad)


def test_small_slo_bench_writes_goodput_attainment_and_caps(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(tmp_path / "tiny", "llama", "tiny")
        cfg = SloBenchConfig(
            model=model,
            out_dir=tmp_path / "out",
            day_night=DayNightConfig(day_s=2.0, peak_rps=6.0, num_bursts=1, max_prompt_len=96),
            tpot_slo_ms=1000.0,
            ttft_slo_ms=10_000.0,
            fixed_caps=(2, 8),
            num_kv_blocks=512,
            threads=1,
            num_windows=4,
            ablation=True,
            ablation_itl_factors=(1.0,),
            slo_fixed=True,
            show_progress=False,
        )
        report = run_slo_bench(cfg)
    finally:
        torch.set_num_threads(threads)
    assert list(report["systems"]) == [
        "adaptive",
        "adaptive-fcfs",
        "adaptive-fcfs-itl1",
        "slo-fixed-2",
        "slo-fixed-8",
        "fixed-2",
        "fixed-8",
    ]
    assert report["best_fixed"] in ("fixed-2", "fixed-8")
    assert report["best_slo_fixed"] in ("slo-fixed-2", "slo-fixed-8")
    assert "adaptive_goodput_vs_best_slo_fixed" in report["ratios"]
    assert "slo-fixed-2_cap" not in report["windows"]  # a held cap has no cap-over-time record
    assert report["ratios"].keys() >= {"adaptive-fcfs_goodput_vs_best_fixed", "adaptive_goodput_vs_best_fixed"}
    n = report["trace"]["num_requests"]
    for s in report["systems"].values():
        assert s["num_completed"] == n
        assert s["goodput_rps"] == pytest.approx(s["num_good"] / report["trace"]["duration_s"])
    assert len(report["windows"]["adaptive_cap"]["max_num_seqs"]) == 4
    assert len(report["windows"]["adaptive-fcfs_cap"]["max_num_seqs"]) == 4
    saved = json.loads((cfg.out_dir / "report.json").read_text())
    assert saved["ratios"]["adaptive_goodput_vs_best_fixed"] == report["ratios"]["adaptive_goodput_vs_best_fixed"]
    assert {p.name for p in cfg.out_dir.iterdir()} >= {"README.md", "slo_attainment.png", "cap_over_time.png"}


def test_goodput_needs_both_targets():
    targets = SloTargets(tpot_ms=50.0, ttft_ms=1000.0)
    assert meets(0.5, 0.04, targets) and meets(0.5, None, targets)
    assert not meets(1.5, 0.01, targets) and not meets(0.1, 0.06, targets)


def test_per_request_pairs_tpot_with_multi_token_outputs():
    from ferry.bench.offline_turns import RunResult
    from ferry.bench.workload import WorkloadRequest

    reqs = [WorkloadRequest(0, [1], 1), WorkloadRequest(1, [1], 4), WorkloadRequest(2, [1], 3)]
    result = RunResult("x", 1.0, ttft_s=[0.1, 0.2, 0.3], tpot_s=[0.02, 0.03], request_indices=[2, 0, 1])
    assert per_request(result, reqs) == {2: (0.1, 0.02), 0: (0.2, None), 1: (0.3, 0.03)}


def test_peak_window_counts_the_busiest_stretch():
    arrivals = [0.0, 0.1, 5.0, 5.2, 5.4, 5.9, 9.0]
    assert peak_window_rps(arrivals, 1.0) == pytest.approx(4.0)  # 5.0 .. 5.9
    assert peak_window_rps(arrivals, 10.0) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="window_s"):
        peak_window_rps(arrivals, 0.0)


def test_peak_load_puts_the_trace_peak_at_that_multiple_of_the_probed_capacity(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(tmp_path / "tiny", "llama", "tiny")
        lm = load_model(model)
        day = DayNightConfig(day_s=4.0, num_bursts=0, max_prompt_len=96)
        common = dict(model=model, out_dir=tmp_path, tpot_slo_ms=20.0, num_kv_blocks=512, num_windows=4)
        _, _, info = load_trace(SloBenchConfig(**common, day_night=day, peak_load=1.5), lm)
        trace = tmp_path / "trace.jsonl"
        trace.write_text(
            "".join(f'{{"timestamp": {t}, "input_length": 40, "output_length": 8}}\n' for t in range(0, 4000, 50))
        )
        _, arrivals, replay = load_trace(SloBenchConfig(**common, trace=str(trace), peak_load=3.0), lm)
    finally:
        torch.set_num_threads(threads)
    capacity = info["capacity"]["capacity_rps"]
    assert capacity > 0 and info["peak_rps"] == pytest.approx(1.5 * capacity)
    assert info["capacity"]["num_requests"] > 0 and info["capacity"]["step_model"]["num_steps"] >= 8
    window = arrivals[-1] / 4
    assert peak_window_rps(arrivals, window) == pytest.approx(3.0 * replay["capacity"]["capacity_rps"], rel=0.1)


def test_the_day_night_peak_is_set_one_way(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--offline", "--model", "x", "--trace", "day-night", "--peak-rps", "3", "--peak-load", "2"]
    )
    with pytest.raises(ValueError, match="--peak-rps and --peak-load"):
        _peak_load(args)
    args = parser.parse_args(["--offline", "--model", "x", "--trace", "day-night"])
    assert _peak_load(args) == DEFAULT_PEAK_LOAD
    args = parser.parse_args(["--offline", "--model", "x", "--trace", "day-night", "--peak-rps", "3"])
    assert _peak_load(args) is None

"""Issue #22's burst workload (`ferry bench --workload burst`) and ferry.bench.throughput's pure parts."""

from __future__ import annotations

import argparse

import pytest

from ferry.bench import cli
from ferry.bench.throughput import burst, hf_static, report
from ferry.bench.workload import BURST, named_workload

pytestmark = pytest.mark.unit


def test_burst_preset_shapes_the_workload_and_options_override_it():
    requests = burst.burst_requests(vocab_size=2048)
    lengths = [len(r.prompt_token_ids) for r in requests]
    assert len(requests) == BURST["num_requests"] == 48
    assert min(lengths) >= 16 and max(lengths) <= 600
    assert {r.max_tokens for r in requests} <= {16, 32, 64, 128, 256}
    assert named_workload("burst", num_requests=5).num_requests == 5
    with pytest.raises(ValueError, match="workload 'nope'"):
        named_workload("nope")


def test_bench_cli_burst_sends_no_ignore_eos(monkeypatch):
    seen = {}

    def fake_run_url(args, workload, out, show_progress=True):
        seen.update(length_control=args.length_control, workload=workload)
        return 0

    monkeypatch.setattr("ferry.bench.online.run_url", fake_run_url)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--url", "http://x", "--workload", "burst", "--out", "/tmp/x"])) == 0
    assert seen["length_control"] == "none" and seen["workload"].max_prompt_len == 600
    assert cli.run(parser.parse_args(["--url", "http://x", "--num-requests", "3", "--out", "/tmp/x"])) == 0
    assert seen["length_control"] == "extra" and seen["workload"].num_requests == 3


def test_prompts_file_round_trip(tmp_path):
    requests = burst.burst_requests(vocab_size=512, num_requests=3)
    back = burst.read_prompts(burst.write_prompts(requests, tmp_path / "p.jsonl"))
    assert [(r.prompt_token_ids, r.max_tokens) for r in back] == [(r.prompt_token_ids, r.max_tokens) for r in requests]


def test_static_generate_counts_only_what_each_request_asked_for():
    assert hf_static._useful([5, 6, 7, 8], max_tokens=3, eos_ids={99}) == 3
    assert hf_static._useful([5, 99, 7, 8], max_tokens=4, eos_ids={99}) == 2  # through its first EOS
    assert hf_static._useful([5, 6], max_tokens=4, eos_ids=set()) == 2


def _system(tok_s: float, ttft_p50_ms: float | None = None, gflops: float = 10.0) -> dict:
    return {"output_tokens_per_s": tok_s, "ttft_ms": {"p50": ttft_p50_ms}, "model_gflops": gflops}


def test_targets_need_equal_or_lower_ttft_against_transformers_serve():
    meta = {"machine_matmul_gflops": 20.0}
    systems = {"ferry-up": _system(400, 900), "hf-serve": _system(90, 800), "engine": _system(420, 700, 13)}
    rows = {(r["numerator"], r["denominator"]): r for r in report.targets(meta, systems)}
    assert rows["ferry-up", "hf-serve"]["value"] == pytest.approx(400 / 90)
    assert rows["ferry-up", "hf-serve"]["met"] is False  # 4.4x, but at a higher TTFT p50
    assert rows["ferry-up", "engine"]["met"] is True
    assert rows["engine", "matmul"]["value"] == pytest.approx(0.65) and rows["engine", "matmul"]["met"]
    assert rows["ferry-generate", "hf-static"]["met"] is None  # not measured
    systems["ferry-up"]["ttft_ms"]["p50"] = 700
    assert {(r["numerator"], r["denominator"]): r for r in report.targets(meta, systems)}["ferry-up", "hf-serve"]["met"]


def test_llamacpp_targets_cover_every_ferry_up_variant_at_equal_or_lower_ttft():
    meta = {"machine_matmul_gflops": 20.0}
    systems = {"ferry-up": _system(100, 900), "ferry-up:f32": _system(80, 500), "llamacpp": _system(45, 600)}
    rows = {(r["numerator"], r["denominator"]): r for r in report.targets(meta, systems)}
    assert rows["ferry-up", "llamacpp"]["value"] == pytest.approx(100 / 45)
    assert rows["ferry-up", "llamacpp"]["met"] is False  # 2.2x, but a higher TTFT p50
    assert rows["ferry-up:f32", "llamacpp"]["value"] == pytest.approx(80 / 45)
    assert rows["ferry-up:f32", "llamacpp"]["met"] is False  # lower TTFT, under 2x
    systems["ferry-up"]["ttft_ms"]["p50"] = 600
    assert {(r["numerator"], r["denominator"]): r for r in report.targets(meta, systems)}["ferry-up", "llamacpp"]["met"]


def test_vllm_targets_sit_beside_llamacpps_for_every_variant():
    meta = {"machine_matmul_gflops": 20.0}
    systems = {"ferry-up": _system(150, 500), "ferry-up:f32": _system(90, 500), "vllm": _system(70, 600)}
    rows = {(r["numerator"], r["denominator"]): r for r in report.targets(meta, systems)}
    assert rows["ferry-up", "vllm"]["value"] == pytest.approx(150 / 70) and rows["ferry-up", "vllm"]["met"]
    assert rows["ferry-up:f32", "vllm"]["met"] is False  # 1.3x
    assert rows["ferry-up", "llamacpp"]["met"] is None and ("ferry-up:f32", "llamacpp") not in rows
    systems["vllm"]["ttft_ms"]["p50"] = 400  # 2.1x, but at a higher TTFT p50
    assert not {(r["numerator"], r["denominator"]): r for r in report.targets(meta, systems)}["ferry-up", "vllm"]["met"]


def test_a_peer_without_its_venv_is_refused_before_anything_runs(tmp_path):
    from ferry.bench.throughput import run

    for peer in ("llamacpp", "vllm"):
        with pytest.raises(SystemExit, match=f"--{peer}-python"):
            run.main(["--out", str(tmp_path / "out"), "--systems", f"ferry-up,{peer}"])
    assert not (tmp_path / "out").exists()


def test_poisson_arrivals_are_for_the_http_systems_only_and_refused_before_anything_runs(tmp_path):
    from ferry.bench.throughput import run

    with pytest.raises(SystemExit, match=r"HTTP systems only \(drop engine, hf-static\)"):
        run.main(["--out", str(tmp_path / "out"), "--systems", "engine,ferry-up,hf-static", "--rate", "3"])
    with pytest.raises(SystemExit, match=r"--rate 0\.0: must be > 0"):
        run.main(["--out", str(tmp_path / "out"), "--systems", "ferry-up", "--rate", "0"])
    assert not (tmp_path / "out").exists()


def test_greedy_texts_are_set_side_by_side_with_agreement():
    from ferry.bench.throughput.greedy import PROMPTS

    texts = [f"answer {i}" for i in range(len(PROMPTS))]
    other = ["answer 0 | x", *texts[1:]]
    systems = {"ferry-up": {"greedy_texts": texts}, "llamacpp": {"greedy_texts": other}, "hf-serve": {}}
    lines = report._greedy(systems)
    assert "| prompt | ferry-up | llamacpp | agree |" in lines
    rows = [line for line in lines if line.startswith(f"| {PROMPTS[0]}")] + [
        line for line in lines if line.startswith(f"| {PROMPTS[1]}")
    ]
    assert rows[0].endswith("equal to ferry-up: none |") and "answer 0 \\| x" in rows[0]
    assert rows[1].endswith("equal to ferry-up: llamacpp |")
    assert report._greedy({"ferry-up": {}}) == []


def test_attention_flops_count_qk_and_pv_over_each_tokens_context():
    from ferry.model.config import ModelConfig

    base = dict(
        arch="llama",
        vocab_size=16,
        hidden_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=8,
        max_position_embeddings=64,
    )
    cfg = ModelConfig(**base)
    # 3 tokens attend to 1, 2 and 3 tokens: 6 contexts x (2 + 2) x heads x head_dim x layers
    assert burst.attention_flops(cfg, [(2, 1)]) == 6 * 4 * 2 * 4 * 2
    assert burst.attention_flops(cfg, [(2, 1), (1, 0)]) == (6 + 1) * 4 * 2 * 4 * 2
    windowed = ModelConfig(**base, sliding_windows=(2, None))
    # layer 0 sees at most 2 tokens: 1 + 2 + 2 contexts; layer 1 all: 1 + 2 + 3
    assert burst.attention_flops(windowed, [(3, 0)]) == (5 + 6) * 4 * 2 * 4
    row = burst.figures(2.0, 10, 10, [], 100.0, attention=1000.0)
    assert row["weight_gflops"] == 100.0 * 20 / 2 / 1e9
    assert row["model_gflops"] == (100.0 * 20 + 1000.0) / 2 / 1e9
    assert row["attention_share_of_flops"] == 1000.0 / 3000.0

"""ferry.bench report arithmetic and the pieces of the HTTP client that need no server."""

from __future__ import annotations

import json
import math
import sys

import pytest

from ferry.bench.http_client import (
    CallResult,
    CompletionCall,
    _apply_event,
    build_body,
    gauge_sum,
    parse_selector,
)
from ferry.bench.online import OnlineConfig, PhaseResult
from ferry.bench.report import markdown_summary, summarize, write_report

pytestmark = pytest.mark.unit


def _result(index: int, chunk_times: list[float], num_out: int | None = None, ok: bool = True) -> CallResult:
    return CallResult(
        index=index,
        sent_at_s=float(index),
        ok=ok,
        chunk_times_s=chunk_times,
        e2e_s=chunk_times[-1] + 0.001 if chunk_times else None,
        num_output_tokens=len(chunk_times) if num_out is None else num_out,
        num_prompt_tokens=10,
        error=None if ok else "HTTP 500: boom",
    )


def test_tpot_and_itl_come_from_chunk_arrival_times():
    r = _result(0, [0.5, 0.6, 0.8, 1.1])
    assert r.ttft_s == 0.5
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_uses_reported_token_count_when_chunks_carry_several_tokens():
    r = _result(0, [0.5, 1.5], num_out=11)  # two chunks, usage says 11 tokens
    assert r.tpot_s == pytest.approx(1.0 / 10)


def test_summary_counts_only_successful_requests():
    phase = PhaseResult(
        name="p",
        rate_rps=2.0,
        duration_s=4.0,
        scheduled_s=[0, 0.5, 1.0],
        results=[_result(0, [0.1, 0.2]), _result(1, [0.3, 0.4, 0.5]), _result(2, [], ok=False)],
    )
    s = summarize(phase)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (3, 2, 1)
    assert s["output_tokens"] == 5
    assert s["output_tokens_per_s"] == pytest.approx(5 / 4.0)
    assert s["requests_per_s"] == pytest.approx(2 / 4.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["errors"] == ["HTTP 500: boom"]
    assert s["offered_rps"] == 2.0 and not s["all_at_once"]


def test_events_count_tokens_from_usage_else_from_chunks():
    r = CallResult(index=0, sent_at_s=0.0)
    _apply_event({"choices": [{"text": "a", "finish_reason": None}]}, 0.1, r)
    _apply_event({"choices": [{"text": "", "finish_reason": None}]}, 0.2, r)  # held-back partial UTF-8
    _apply_event({"choices": [{"text": "", "finish_reason": "length"}]}, 0.3, r)  # closing, no token
    assert r.chunk_times_s == [0.1, 0.2] and r.finish_reason == "length"
    _apply_event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}, 0.4, r)
    assert (r.num_output_tokens, r.num_prompt_tokens) == (3, 7)
    _apply_event({"error": {"message": "overloaded"}}, 0.5, r)
    assert r.error == "stream error: overloaded"


def test_body_per_length_control():
    call = CompletionCall(index=0, prompt=[1, 2, 3], max_tokens=32, num_prompt_tokens=3)
    extra = build_body(call, "m", "extra")
    assert extra["ignore_eos"] is True and extra["min_tokens"] == 32 and extra["stream"] is True
    hf = build_body(call, "m", "hf-generation-config")
    assert "ignore_eos" not in hf and "stream_options" not in hf
    assert json.loads(hf["generation_config"])["min_new_tokens"] == 32
    assert "min_tokens" not in build_body(call, "m", "none")
    with pytest.raises(ValueError, match="length_control"):
        build_body(call, "m", "bogus")


def test_config_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="base_url"):
        OnlineConfig(base_url="127.0.0.1:8000", model="m")
    with pytest.raises(ValueError, match="max_concurrency"):
        OnlineConfig(base_url="http://127.0.0.1:8000", model="m", max_concurrency=0)


def test_gauge_sum_with_label_selector():
    text = (
        "# TYPE ferry_requests_running gauge\n"
        'ferry_requests_running{role="decode"} 3\nferry_requests_running{role="prefill"} 5\n'
    )
    assert gauge_sum(text, 'ferry_requests_running{role="decode"}') == 3.0
    assert gauge_sum(text, "ferry_requests_running") == 8.0
    assert gauge_sum(text, "ferry_absent") is None
    assert parse_selector('m{a="x", b="y"}') == ("m", {"a": "x", "b": "y"})


def _phases() -> list[PhaseResult]:
    return [
        PhaseResult(
            name="offline",
            rate_rps=math.inf,
            duration_s=1.0,
            scheduled_s=[0.0, 0.0],
            results=[_result(0, [0.1, 0.2, 0.3]), _result(1, [0.2, 0.25])],
            batch_samples=[(0.0, 1.0), (0.5, 2.0)],
        ),
        PhaseResult(
            name="poisson-2",
            rate_rps=2.0,
            duration_s=2.0,
            scheduled_s=[0.0, 0.4],
            results=[_result(0, [0.1, 0.2]), _result(1, [0.1, 0.3])],
        ),
    ]


def test_report_files_are_written(tmp_path):
    report = write_report(tmp_path, {"target": "http://x", "model": "m"}, _phases())
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["summary"] == json.loads(json.dumps(report["summary"]))
    assert [s["all_at_once"] for s in written["summary"]] == [True, False]
    assert written["summary"][0]["mean_batch_size"] == 1.5
    for name in ("throughput_vs_load.png", "ttft_cdf.png", "itl_cdf.png", "batch_size.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "summary.md").read_text()
    assert "| offline | all at once | 2/2 |" in md and "![ttft_cdf.png](ttft_cdf.png)" in md
    assert markdown_summary(report, []).count("\n| ") == 3  # header + two phases


def test_nested_report_has_no_plots(tmp_path):
    write_report(tmp_path, {"target": "http://x", "model": "m"}, _phases(), plots=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "summary.md"]


def test_missing_matplotlib_names_the_extra_after_the_json_is_written(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'ferry\[bench\]'"):
        write_report(tmp_path, {"target": "http://x", "model": "m"}, _phases())
    assert json.loads((tmp_path / "bench.json").read_text())["summary"]

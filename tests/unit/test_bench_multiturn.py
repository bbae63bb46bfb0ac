"""The multi-turn bench's seeded conversations and its summary (the HTTP part runs in the bench)."""

from __future__ import annotations

import pytest

from ferry.bench.multiturn import ConversationConfig, TurnResult, make_conversations, summarize

pytestmark = pytest.mark.unit


def test_conversations_are_seeded_and_share_the_system_prompt():
    config = ConversationConfig(num_users=3, num_turns=2, system_prompt_len=20, user_len_median=8, seed=5)
    system, conversations = make_conversations(config)
    again_system, again = make_conversations(config)
    assert (system, conversations) == (again_system, again)
    assert len(system) == 20 and len(conversations) == 3
    for conv in conversations:
        assert len(conv.messages) == len(conv.think_s) == 3  # one more for the turn after the restart
        assert all(4 <= len(m) <= 32 for m in conv.messages)
        assert all(3 <= t < config.vocab_size for m in conv.messages for t in m)
    assert make_conversations(ConversationConfig(seed=6))[0] != make_conversations(ConversationConfig(seed=5))[0]


def test_summary_has_ttft_per_turn_and_throughput():
    results = [
        TurnResult(0, 1, 100, True, 0.100, 1.0, 64),
        TurnResult(1, 1, 100, True, 0.300, 1.0, 64),
        TurnResult(0, 2, 200, True, 0.050, 1.0, 64),
        TurnResult(1, 2, 200, False, error="HTTP 500"),
    ]
    summary = summarize(results, wall_s=4.0)
    assert summary["ttft_ms_by_turn"]["1"]["p50"] == pytest.approx(200.0)
    assert summary["ttft_ms_by_turn"]["2"]["count"] == 1
    assert summary["ttft_ms_turn_2_on"]["p50"] == pytest.approx(50.0)
    assert (summary["num_turns_ok"], summary["num_errors"], summary["errors"]) == (3, 1, ["HTTP 500"])
    assert summary["output_tokens_per_s"] == pytest.approx(3 * 64 / 4.0)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="num_turns"):
        ConversationConfig(num_turns=0)


def test_report_renders_from_a_saved_report(tmp_path):
    from pathlib import Path

    from ferry.bench.multiturn_report import write_markdown, write_plot

    saved = Path(__file__).parents[2] / "ops/bench/multiturn/20261204-answers96/multiturn.json"
    report = __import__("json").loads(saved.read_text())
    write_markdown(tmp_path / "README.md", report)
    write_plot(tmp_path / "ttft.png", report)
    text = (tmp_path / "README.md").read_text()
    assert "| 2 | 96 | 58 | 1.66 |" in text and "**1.80x**" in text
    assert (tmp_path / "ttft.png").stat().st_size > 1000


def test_report_says_both_modes_were_warmed_up(tmp_path):
    from pathlib import Path

    from ferry.bench.multiturn_report import write_markdown

    saved = Path(__file__).parents[2] / "ops/bench/multiturn/20261204-warm-answers256/multiturn.json"
    report = __import__("json").loads(saved.read_text())
    write_markdown(tmp_path / "README.md", report)
    text = (tmp_path / "README.md").read_text()
    assert "one turn of 4 unrelated conversations" in text and "Again after the restart" in text
    assert "| 1 | 86 | 83 | 1.04 |" in text and "**3.27x**" in text
    report["config"]["warmup_users"] = 0
    write_markdown(tmp_path / "README.md", report)
    assert "No warm-up" in (tmp_path / "README.md").read_text()


def test_report_shows_the_partial_block_tokens_copied(tmp_path):
    from pathlib import Path

    from ferry.bench.multiturn_report import write_markdown

    saved = Path(__file__).parents[2] / "ops/bench/multiturn/20261204-warm-answers256/multiturn.json"
    report = __import__("json").loads(saved.read_text())
    on = report["modes"]["on"]
    on["prefix_blocks_by_tier"] |= {"device": 10, "host": 5, "remote": 0, "computed": 3, "partial_tokens": 77}
    on["after_restart"]["prefix_blocks_by_tier"] = {"device": 1, "host": 2, "remote": 0, "computed": 4}
    write_markdown(tmp_path / "README.md", report)
    text = (tmp_path / "README.md").read_text()
    assert "| on | 10 | 5 | 0 | 3 | 77 | 1 | 2 | 0 | 4 |  |" in text  # an older report: no partial count


def test_hop_trace_splits_a_turns_ttft_and_finds_its_first_token_step():
    from ferry.bench.multiturn_trace import breakdown, request_hops

    def hop(t, rid, name, pid=1, **info):
        return {"t": t, "rid": rid, "hop": name, "pid": pid, **info}

    lines = [
        hop(10.002, "a", "gw.http", 9),
        hop(10.003, "a", "gw.submit", 9),
        hop(10.004, "a", "pb.submit", 8),
        hop(10.005, "a", "pb.routed", 8),
        hop(10.006, "a", "pw.pulled"),
        hop(10.007, "a", "pw.settled"),
        hop(10.008, "a", "pw.prefix"),
        hop(10.000, "*", "pw.step_start"),  # a step already running when it was admitted
        hop(10.010, "*", "pw.step_end", outputs=1, seqs=1, prefill_tokens=300),
        hop(10.011, "*", "pw.step_start"),
        hop(10.041, "*", "pw.step_end", outputs=1, seqs=1, prefill_tokens=40),
        hop(10.020, "*", "pw.step_start", 2),  # another process's steps (the decode worker's): not its
        hop(10.060, "*", "pw.step_end", 2, outputs=1, seqs=1, prefill_tokens=99),
        hop(10.042, "a", "pw.published"),
        hop(10.043, "a", "gw.event", 9),
        hop(10.044, "a", "gw.sse", 9),
        hop(10.050, "*", "pw.step_start"),  # after its token: not its
        hop(10.090, "*", "pw.step_end", outputs=1, seqs=1, prefill_tokens=5),
    ]
    turn = TurnResult(0, 2, 300, True, ttft_s=0.045, request_id="a", sent_at=10.000)
    other = TurnResult(1, 2, 300, True, ttft_s=0.1, request_id="not-traced", sent_at=10.0)
    rows = request_hops(lines, [turn, other])
    assert len(rows) == 1 and rows[0]["turn"] == 2
    assert (rows[0]["pw.first_step"], rows[0]["pw.step_start"], rows[0]["pw.step_end"]) == (10.011, 10.011, 10.041)
    assert rows[0]["step_prefill_tokens"] == 40 and rows[0]["num_steps"] == 1
    summary = breakdown(rows)
    segments = summary["segments"]
    assert segments["pw.step_start>pw.step_end"]["p50"] == pytest.approx(30.0)
    assert segments["pw.prefix>pw.first_step"]["p50"] == pytest.approx(3.0)  # waited for the running step
    # the segments tile the path: their means add up to the mean TTFT
    assert sum(s["mean"] for s in segments.values()) == pytest.approx(summary["ttft_ms"]["mean"]) == 45.0

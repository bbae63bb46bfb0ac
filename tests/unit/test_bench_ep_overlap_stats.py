"""The overlap bench's hidden fraction: the part of the sequential step's all-to-all time that the
overlapped step no longer pays, neither blocked in wait() nor as compute slowed by the transfers;
faster overlapped compute does not count as hidden communication, the all-gather (once per step in
every mode) is not all-to-all time, and each round is judged on its own steps."""

from __future__ import annotations

import pytest

from ferry.bench.ep_overlap_stats import summarise_phase

pytestmark = pytest.mark.unit


def _sample(compute_ms: float, a2a_ms: float, all_gather_ms: float = 1.0, rows: int = 100) -> dict:
    step_s = (compute_ms + a2a_ms + all_gather_ms) / 1000
    return {
        "step_s": step_s,
        "a2a_s": a2a_ms / 1000,
        "all_gather_s": all_gather_ms / 1000,
        "by_collective": {"dispatch": a2a_ms / 2000, "combine": a2a_ms / 2000},
        "expert_rows": rows,
        "waits": [a2a_ms / 2000, a2a_ms / 2000],
    }


def _ranks(modes_per_step: list[dict[str, tuple[float, float]]]) -> list[dict]:
    """Two ranks with the same samples: {mode: (compute ms, all-to-all ms)} per triple."""
    phase = {mode: [_sample(*step[mode]) for step in modes_per_step] for mode in ("single", "sequential", "overlap")}
    return [{"decode": phase}, {"decode": phase}]


def test_time_that_leaves_wait_but_slows_compute_is_not_hidden():
    # sequential: 100 ms compute + 20 ms all-to-all; overlap blocks 2 ms but computes 10 ms longer
    triples = [{"single": (80, 10), "sequential": (100, 20), "overlap": (110, 2)}] * 4
    summary = summarise_phase(_ranks(triples), "decode", steps_per_round=2)
    assert summary["run"]["hidden_fraction"] == pytest.approx(1 - (2 + 10) / 20)
    assert summary["run"]["hidden_by_step_fraction"] == pytest.approx(8 / 20)  # the all-gather cancels
    assert summary["run"]["hidden_blocked_fraction"] == pytest.approx(1 - 2 / 20)
    assert summary["run"]["compute_extra_ms_overlap"] == pytest.approx(10)
    assert summary["per_round"]["hidden_fraction"] == pytest.approx([0.4, 0.4])


def test_faster_overlapped_compute_is_not_counted_as_hidden_communication():
    triples = [{"single": (80, 10), "sequential": (100, 20), "overlap": (95, 4)}] * 2
    summary = summarise_phase(_ranks(triples), "decode", steps_per_round=2)
    assert summary["run"]["hidden_fraction"] == pytest.approx(1 - 4 / 20)
    assert summary["run"]["hidden_by_step_fraction"] == pytest.approx(21 / 20)


def test_each_round_is_judged_on_its_own_steps_and_the_worst_is_reported():
    good = {"single": (80, 10), "sequential": (100, 20), "overlap": (100, 2)}
    bad = {"single": (80, 10), "sequential": (100, 20), "overlap": (100, 10)}
    summary = summarise_phase(_ranks([good, good, bad, bad]), "decode", steps_per_round=2)
    assert summary["per_round"]["hidden_fraction"] == pytest.approx([0.9, 0.5])
    assert summary["min_round_hidden_fraction"] == pytest.approx(0.5)
    assert summary["modes"]["sequential"]["a2a_blocked_ms"] == pytest.approx(20)


def test_steps_that_are_not_whole_rounds_are_refused():
    triples = [{"single": (80, 10), "sequential": (100, 20), "overlap": (100, 2)}] * 3
    with pytest.raises(ValueError, match="not whole rounds of 2"):
        summarise_phase(_ranks(triples), "decode", steps_per_round=2)


def test_the_lighter_ranks_wait_for_the_heavier_one_is_imbalance_not_all_to_all_time():
    # rank 1 computes 10 ms more in every step; rank 0 waits that out in some collective, in both modes
    def rank(extra_compute: float, extra_wait: float) -> dict:
        steps = {"single": (80, 10), "sequential": (100, 20), "overlap": (100, 4)}
        return {
            "decode": {
                mode: [_sample(compute + extra_compute, a2a + extra_wait)] * 2 for mode, (compute, a2a) in steps.items()
            }
        }

    summary = summarise_phase([rank(0, 10), rank(10, 0)], "decode", steps_per_round=2)
    assert summary["run"]["a2a_ms_sequential"] == pytest.approx(20)
    assert summary["run"]["hidden_fraction"] == pytest.approx(1 - 4 / 20)
    assert summary["run"]["a2a_ms_sequential_ranks_mean"] == pytest.approx(25)
    assert summary["run"]["hidden_fraction_ranks_mean"] == pytest.approx(1 - 9 / 25)

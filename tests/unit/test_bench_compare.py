"""ops/bench/compare/ratios.py: the comparison report's ratios and markdown (pure, no servers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parents[2] / "ops" / "bench" / "compare" / "ratios.py"
_spec = importlib.util.spec_from_file_location("compare_ratios", _PATH)
ratios = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ratios)


def _summary(tok_s: float, ttft_p50: float | None, num: int = 8) -> dict:
    return {"num_requests": num, "output_tokens_per_s": tok_s, "requests_per_s": tok_s / 100,
            "ttft_ms": {"p50": ttft_p50, "p99": None}, "tpot_ms": {"p50": 10.0, "p99": 20.0},
            "e2e_ms": {"p50": 1.0, "p99": 2.0}}


def test_ratios_pair_systems_phase_by_phase():
    systems = {"engine-static": {"all-at-once": _summary(100, 400), "poisson-1rps": _summary(50, 100)},
               "engine-dynamic": {"all-at-once": _summary(300, 100)},
               "hf-serve": {"all-at-once": _summary(150, 0.0)}}
    pairs = ratios.ratios(systems)
    by_key = {(p["numerator"], p["denominator"], p["phase"]): p["ratios"] for p in pairs}
    assert set(by_key) == {("engine-dynamic", "engine-static", "all-at-once"),
                           ("engine-dynamic", "hf-serve", "all-at-once")}   # only phases both ran
    static = by_key[("engine-dynamic", "engine-static", "all-at-once")]
    assert static["output_tokens_per_s"] == pytest.approx(3.0)
    assert static["ttft_ms.p50"] == pytest.approx(0.25)
    assert static["ttft_ms.p99"] is None                                     # missing figure, no ratio
    assert by_key[("engine-dynamic", "hf-serve", "all-at-once")]["ttft_ms.p50"] is None   # no division by 0


def test_markdown_lists_figures_ratios_and_systems_that_did_not_run(tmp_path):
    systems = {"engine-static": {"all-at-once": _summary(100, 400)},
               "engine-dynamic": {"all-at-once": _summary(300, 100)}}
    md = ratios.markdown({"workload": "w"}, systems, {"hf-serve": "exited with 1"}, ratios.ratios(systems))
    assert "| engine-dynamic / engine-static | all-at-once | 3.00 |" in md
    assert "| engine-static | all-at-once | 8/8 | 100.0 |" in md
    assert "- **hf-serve**: exited with 1" in md
    assert ratios.plot(tmp_path / "c.png", systems) and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"

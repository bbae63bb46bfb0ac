"""ferry.bench.compare: the comparison's ratios, issue #9 targets and report (pure, no servers)."""

from __future__ import annotations

import json

import pytest
from waiting import wait_until_sync

from ferry.bench.compare import engines, ratios, render, servers

pytestmark = pytest.mark.unit

POISSON = "poisson-0.5rps"


def _summary(tok_s: float, e2e_p99: float = 1000.0, ttft_p50: float | None = 100.0, num: int = 8) -> dict:
    return {
        "num_requests": num,
        "output_tokens": 800,
        "output_tokens_per_s": tok_s,
        "requests_per_s": tok_s / 100,
        "ttft_ms": {"p50": ttft_p50, "p99": None},
        "tpot_ms": {"p50": 10.0, "p99": 20.0},
        "e2e_ms": {"p50": 1.0, "p99": e2e_p99},
    }


def _systems() -> dict:
    """Poisson throughputs are equal (everyone keeps up); capacity and latency differ."""
    return {
        "engine-static-padded": {"all-at-once": _summary(50), POISSON: _summary(40, e2e_p99=2000, ttft_p50=800)},
        "engine-static": {"all-at-once": _summary(100), POISSON: _summary(40, e2e_p99=1500, ttft_p50=400)},
        "engine-dynamic": {"all-at-once": _summary(160), POISSON: _summary(40, e2e_p99=1000, ttft_p50=100)},
        "ferry-up": {"all-at-once": _summary(200), POISSON: _summary(40, e2e_p99=1000, ttft_p50=0.0)},
        "hf-serve": {"all-at-once": _summary(40)},
    }


def _by_key(rows: list[dict]) -> dict:
    return {(p["numerator"], p["denominator"], p["phase"]): p for p in rows}


def test_throughput_comes_from_all_at_once_and_latency_from_poisson():
    pairs = _by_key(ratios.ratios(_systems()))
    capacity = pairs[("engine-dynamic", "engine-static-padded", "all-at-once")]["values"]
    assert capacity == {"output_tokens_per_s": pytest.approx(3.2), "requests_per_s": pytest.approx(3.2)}
    latency = pairs[("engine-dynamic", "engine-static-padded", POISSON)]["values"]
    assert "output_tokens_per_s" not in latency  # equal offered load: a throughput ratio would say 1.00x
    assert latency["e2e_ms.p99"] == pytest.approx(0.5)  # 1000 ms vs 2000 ms: 50% lower
    assert latency["ttft_ms.p50"] == pytest.approx(0.875)
    assert latency["ttft_ms.p99"] is None  # missing figure, no ratio
    assert ("ferry-up", "hf-serve", POISSON) not in pairs  # only phases both systems ran
    assert pairs[("ferry-up", "engine-static", "all-at-once")]["clocks"] == "wall/engine"


def test_a_missing_or_zero_denominator_gives_no_ratio():
    assert ratios.compare(_summary(10, ttft_p50=5.0), _summary(10, ttft_p50=0.0), "ttft_ms.p50") is None
    assert ratios.compare(_summary(10, ttft_p50=5.0), _summary(10, ttft_p50=None), "ttft_ms.p50") is None
    assert ratios.compare(_summary(10, ttft_p50=5.0), _summary(10, ttft_p50=10.0), "ttft_ms.p50") == 0.5


def test_targets_say_which_are_met_and_which_were_not_measured():
    systems = _systems()
    del systems["engine-static-padded"][POISSON]  # e.g. padded could not run with Poisson arrivals
    rows = {(t["numerator"], t["denominator"], t["figure"]): t for t in ratios.targets(systems)}
    x3 = rows[("ferry-up", "engine-static-padded", "output_tokens_per_s")]
    assert (x3["value"], x3["met"], x3["phase"]) == (pytest.approx(4.0), True, "all-at-once")
    assert rows[("ferry-up", "engine-static", "output_tokens_per_s")]["met"] is False  # 2x < 3x
    p99 = rows[("ferry-up", "engine-static-padded", "e2e_ms.p99")]
    assert (p99["value"], p99["met"], p99["phase"]) == (None, None, None)
    assert rows[("ferry-up", "engine-static", "e2e_ms.p99")]["value"] == pytest.approx(1 / 3)  # < 45%: not met
    assert rows[("ferry-up", "engine-static", "e2e_ms.p99")]["met"] is False
    assert rows[("ferry-up", "hf-serve", "output_tokens_per_s")]["met"] is True  # 5x >= 4x


def test_unknown_phase_names_are_rejected():
    with pytest.raises(ValueError, match="phase 'warm-up'"):
        ratios.phase_kind("warm-up")
    with pytest.raises(ValueError, match="phase 'all-at-once': not a 'poisson-<rate>rps' phase"):
        ratios.phase_rate("all-at-once")
    assert ratios.phase_rate("poisson-1.1807rps") == pytest.approx(1.1807)


def test_poisson_rate_and_how_hard_it_pushes_each_system():
    systems = _systems()
    assert ratios.poisson_rate(systems, "engine-static", 0.5) == pytest.approx(0.5)  # 1.0 req/s capacity
    with pytest.raises(ValueError, match="rate base 'engine-static-padded'"):
        ratios.poisson_rate({"engine-static": systems["engine-static"]}, "engine-static-padded", 0.5)
    fractions = ratios.poisson_loads(systems)[POISSON]  # its nominal rate, from the name
    assert fractions["engine-static-padded"] == pytest.approx(1.0)  # saturated: not a moderate rate for it
    assert fractions["ferry-up"] == pytest.approx(0.25)
    assert "hf-serve" in fractions  # capacity known, Poisson phase or not


def test_markdown_answers_the_targets_and_lists_what_did_not_run(tmp_path):
    systems = _systems()
    md = render.markdown(
        {"workload": "w"},
        systems,
        {"hf-serve, poisson-0.5rps": "exited with 1"},
        ratios.ratios(systems),
        ratios.targets(systems),
    )
    assert (
        "| distributed >= 3x static batching, output tok/s offline (classic padded) | ferry-up / "
        "engine-static-padded (output tok/s) | all-at-once | wall/engine | 4.00x | >= 3x | **yes** |"
    ) in md
    assert "| ferry-up / engine-static (E2E p99) | poisson-0.5rps | wall/engine | 33% | >= 45% lower | no |" in md
    assert "| engine-static | engine | all-at-once | 8/8 | 800 | 100.0 |" in md
    assert "- **hf-serve, poisson-0.5rps**: exited with 1" in md
    assert "**Saturated at this rate: engine-static-padded, hf-serve** (offered load >= its capacity" in md
    assert render.plot(tmp_path / "c.png", systems) and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_rerender_applies_the_current_definitions_to_an_old_report(tmp_path):
    (tmp_path / "compare.json").write_text(
        json.dumps({"meta": {"date_utc": "then"}, "systems": _systems(), "ratios": [{"old": "format"}]})
    )
    render.rerender(tmp_path)
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["ratios"] == ratios.ratios(_systems()) and doc["targets"] == ratios.targets(_systems())
    assert "## Issue #9 targets" in (tmp_path / "compare.md").read_text()


def _turns(fail_at: int | None, steps: int = 3):
    for i in range(steps):
        if i == fail_at:
            raise ValueError("static_padded: needs every request to arrive at once")
        yield 1
    return f"done after {steps}"


def test_a_mode_offline_py_cannot_run_becomes_a_problem_not_a_crash():
    problems: dict[str, str] = {}
    guarded = engines._guarded(_turns(fail_at=1), "engine-static-padded, poisson-1rps", problems)
    assert next(guarded) == 1
    with pytest.raises(StopIteration) as stop:
        next(guarded)
    assert stop.value.value is None
    assert "needs every request to arrive at once" in problems["engine-static-padded, poisson-1rps"]
    ok = engines._guarded(_turns(fail_at=None), "engine-static, poisson-1rps", problems)
    assert list(ok) == [1, 1, 1] and len(problems) == 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, just not reaped yet
    except FileNotFoundError:
        return False


def test_stop_lets_the_server_shut_down_then_leaves_nothing_of_its_group(tmp_path):
    """Only the leader gets SIGTERM (ferry up must stop its services before its nats-server, which
    would otherwise get SIGTERM at the same moment); whatever it leaves in its group is killed."""
    child_script = (
        f"trap 'echo got-term > {tmp_path}/child-term; exit 0' TERM; touch {tmp_path}/child-trapped; "
        "while :; do sleep 0.05; done"
    )
    script = (
        f"trap 'echo stopped > {tmp_path}/flag; exit 0' TERM; bash -c \"{child_script}\" & "
        f"echo $! > {tmp_path}/child; while :; do sleep 0.05; done"
    )
    server = servers.spawn("leader", ["bash", "-c", script], "http://127.0.0.1:1", tmp_path)
    pid_file, trapped = tmp_path / "child", tmp_path / "child-trapped"
    child = int(
        wait_until_sync(lambda: trapped.exists() and pid_file.exists() and pid_file.read_text().strip(), "trap")
    )
    servers.stop(server, grace_s=10)
    assert (tmp_path / "flag").read_text().strip() == "stopped"  # the leader's own shutdown ran
    assert server.process.returncode == 0
    wait_until_sync(lambda: not _alive(child), "the child killed with the group")
    assert not (tmp_path / "child-term").exists()  # the child never saw SIGTERM

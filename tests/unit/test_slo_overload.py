"""SloController.decode_plan under overload: the cap protects the TPOT of the requests running.

Goodput counts the requests that meet both targets. Overloaded, every step carries the prefill
that keeps the batch full (b / mean_output admissions, mean_prompt tokens each), so at cap b a
request's TPOT is step(b) and the cap serves b / (mean_output x step(b)) requests/s; past the
largest b whose step holds the target, every running request misses TPOT. The old rule took the
decode-only cap there (a step without prefill: 3-4x larger here), so these tests fail on it.
"""

import pytest

from ferry.slo import ControllerLimits, SloController, SloTargets, StepRecord, StepTimeModel, TokenMix

pytestmark = pytest.mark.unit

TPOT = 50.0
CHAT = TokenMix(mean_prompt_tokens=400, mean_output_tokens=80)  # the Mooncake replay's mix, about
SHARE = CHAT.mean_prompt_tokens / CHAT.mean_output_tokens  # prefill tokens per running seq per step


def machine_ms(seqs, prefill, context):  # the load-3.5 run's fitted step, rounded
    return 3.2 + 0.12 * seqs + 17.6 * prefill / 100 + 0.5 * context / 1000


def controller(**limits) -> SloController:
    model = StepTimeModel(forgetting=1.0)
    for i in range(400):
        seqs, prefill, context = 1 + i % 97, (i * 37) % 700, (1 + i % 97) * (20 + (i * 13) % 500)
        model.observe(StepRecord(seqs, prefill, context, machine_ms(seqs, prefill, context)))
    return SloController(model, SloTargets(tpot_ms=TPOT, ttft_ms=2000.0), ControllerLimits(**limits))


def full_step(b: int) -> float:
    return machine_ms(b, b * SHARE, b * CHAT.mean_context_tokens)


def served_rps(b: int) -> float:
    return b / CHAT.mean_output_tokens / (full_step(b) / 1000)


def test_overloaded_the_cap_is_the_largest_whose_full_step_holds_tpot():
    ctl = controller()
    capacity = ctl.decode_plan(CHAT, True, 1.0).capacity_rps
    for rate in (1.01 * capacity, 3.5 * capacity, None):  # None: the batch always full
        plan = ctl.decode_plan(CHAT, True, rate)
        b = plan.max_num_seqs
        assert plan.is_overloaded and plan.is_feasible
        assert full_step(b) <= TPOT + 0.5 < full_step(b + 2)  # the model's fit is close, not exact
        assert plan.predicted_step_ms <= TPOT
    decode_only = max(b for b in range(4, 257) if machine_ms(b, 0, b * CHAT.mean_context_tokens) <= TPOT)
    assert decode_only > 3 * b  # what the old rule took: every running request would miss TPOT


def test_the_overloaded_cap_serves_the_most_requests_on_time():
    """Among the caps whose step holds TPOT (the only ones whose requests count), the largest
    serves the most per second; a larger one serves none on time."""
    b = controller().decode_plan(CHAT, True, 100.0).max_num_seqs
    in_target = [k for k in range(1, 257) if full_step(k) <= TPOT]
    assert max(in_target) - 1 <= b <= max(in_target)
    assert served_rps(b) >= max(served_rps(k) for k in in_target) * 0.98


def test_a_rising_overload_does_not_raise_the_cap():
    ctl = controller()
    caps = [ctl.decode_plan(CHAT, True, rate).max_num_seqs for rate in (30.0, 60.0, 120.0, 1000.0)]
    assert len(set(caps)) == 1  # the old rule: the Little floor grew with the rate up to decode-only


def test_infeasible_takes_the_minimum_cap():
    ctl = controller(min_num_seqs=8)
    documents = TokenMix(mean_prompt_tokens=1000, mean_output_tokens=8)  # 125 tokens per seq per step
    plan = ctl.decode_plan(documents, True, 50.0)
    assert (plan.max_num_seqs, plan.is_feasible, plan.is_overloaded, plan.capacity_rps) == (8, False, True, 0.0)

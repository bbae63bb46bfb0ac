"""Seats beyond the cap: never hold a prompt back for the cap when that makes it miss its TTFT and
admitting it keeps the running requests' TPOT (or saves more requests than it loses); and the cap
plans with the prefill the arrivals bring, not a full batch's."""

import math

import pytest

from ferry.slo import (
    ControllerLimits,
    QueuedPrompt,
    RunningDecode,
    SloController,
    SloTargets,
    StepRecord,
    StepTimeModel,
    TokenMix,
)
from ferry.slo.admission import num_losing_tpot, seats_to_add

pytestmark = pytest.mark.unit


def ms_per_token(tokens):
    return 1.0 * tokens


def nobody_loses(k):
    return 0


def always_fits(k):
    return True


def test_a_prompt_the_cap_would_make_late_gets_a_seat_when_no_running_request_loses_tpot():
    held = [QueuedPrompt("a", 0.0, 200)]
    # a seat frees in 1.5 s, then 200 ms of prefill: ends at 1.7 s, past its 1.6 s deadline
    assert seats_to_add(held, 0.0, 1.6, 1500.0, ms_per_token, nobody_loses, always_fits) == 1
    # a seat frees in 100 ms: waiting still makes the deadline, the cap holds
    assert seats_to_add(held, 0.0, 1.6, 100.0, ms_per_token, nobody_loses, always_fits) == 0
    assert seats_to_add([], 0.0, 1.6, 1500.0, ms_per_token, nobody_loses, always_fits) == 0


def test_seats_stop_where_the_newcomers_own_steps_miss_tpot():
    held = [QueuedPrompt(k, 0.0, 100) for k in "abcd"]
    assert seats_to_add(held, 0.0, 1.0, math.inf, ms_per_token, nobody_loses, lambda k: k <= 2) == 2


def test_seats_pay_only_when_they_save_more_requests_than_they_break():
    held = [QueuedPrompt(k, 0.0, 100) for k in "abc"]
    one_each = lambda k: k  # noqa: E731  every seat costs a running request its TPOT
    assert seats_to_add(held, 0.0, 1.0, math.inf, ms_per_token, one_each, always_fits) == 0
    one_in_all = lambda k: 1  # noqa: E731  the first seat breaks the tightest, later seats nobody more
    assert seats_to_add(held, 0.0, 1.0, math.inf, ms_per_token, one_in_all, always_fits) == 3
    early = [QueuedPrompt("early", 0.0, 100)]  # makes its deadline by waiting: not worth a lost request
    assert seats_to_add(early, 0.0, 1.0, 100.0, ms_per_token, one_in_all, always_fits) == 0


def test_requests_losing_tpot_are_those_whose_slack_the_longer_steps_use_up():
    decodes = [
        RunningDecode("loose", first_token_s=0.0, num_after_first=10, num_remaining=10),  # slack 700 ms
        RunningDecode("tight", first_token_s=0.0, num_after_first=10, num_remaining=2),  # slack 380 ms
        RunningDecode("lost", first_token_s=0.0, num_after_first=1, num_remaining=1),  # past saving
    ]
    assert num_losing_tpot(decodes, 0.2, 50.0, 10.0, extra_step_ms=50.0) == 0
    assert num_losing_tpot(decodes, 0.2, 50.0, 10.0, extra_step_ms=75.0) == 1  # loose: 10 x 75 > 700
    assert num_losing_tpot(decodes, 0.2, 50.0, 10.0, extra_step_ms=200.0) == 2  # "lost" never counts


def machine_ms(seqs, prefill, context):
    return 5.0 + 0.5 * seqs + 20.0 * prefill / 100 + 3.0 * context / 1000


def controller(tpot_ms=50.0):
    model = StepTimeModel(forgetting=1.0)
    for i in range(400):
        seqs, prefill, context = 1 + i % 37, (i * 37) % 700, (1 + i % 37) * (20 + (i * 13) % 500)
        model.observe(StepRecord(seqs, prefill, context, machine_ms(seqs, prefill, context)))
    return SloController(model, SloTargets(tpot_ms=tpot_ms, ttft_ms=2000.0), ControllerLimits())


DOCUMENTS = TokenMix(mean_prompt_tokens=700, mean_output_tokens=36)


def test_a_light_load_of_documents_plans_with_the_prefill_that_arrives_not_a_full_batchs():
    ctl = controller()
    full = ctl.decode_plan(DOCUMENTS).max_num_seqs  # every step admits b / 36 documents
    light = ctl.decode_plan(DOCUMENTS, rate_rps=1.0)  # 700 prompt tokens a second arrive
    assert light.max_num_seqs > full
    cap, context = light.max_num_seqs, light.max_num_seqs * DOCUMENTS.mean_context_tokens
    step = (5.0 + 0.5 * cap + 3.0 * context / 1000) / (1 - 0.7 * 0.2)  # prefill per step = 0.7 x step ms
    assert step <= 50.0 + 1.0  # the model's fit is close, not exact
    overloaded = ctl.decode_plan(DOCUMENTS, rate_rps=100.0)  # every step carries a full batch's prefill
    assert overloaded.capacity_rps == pytest.approx(ctl.decode_plan(DOCUMENTS).capacity_rps)
    assert overloaded.max_num_seqs == full and overloaded.is_overloaded  # the rest queue (test_slo_overload.py)


def test_when_prefill_alone_breaks_tpot_the_cap_is_the_minimum_not_the_decode_only_one():
    plan = controller(tpot_ms=25.0).decode_plan(DOCUMENTS)  # 4 seqs with a full batch's prefill: ~31 ms
    assert not plan.is_feasible and plan.is_overloaded and plan.capacity_rps == 0.0
    assert plan.max_num_seqs == ControllerLimits().min_num_seqs  # the decode-only cap would be ~8


def running(num, first_token_s, num_after_first, num_remaining):
    return [RunningDecode(f"d{i}", first_token_s, num_after_first, num_remaining) for i in range(num)]


def test_admit_raises_the_cap_for_a_prompt_it_would_make_late():
    ctl = controller()
    new = [QueuedPrompt("new", 0.0, 200)]
    # 4 decodes just started, 200 tokens each to go: the first seat frees in ~2 s, past the deadline
    assert ctl.admit(new, running(4, 0.0, 0, 200), 1200, 0.0, cap=4).max_num_seqs == 5
    # they end in ~10 steps: waiting is on time, the cap holds
    assert ctl.admit(new, running(4, 0.0, 0, 10), 1200, 0.0, cap=4).max_num_seqs == 4
    # a free seat already: nothing to add
    assert ctl.admit(new, running(3, 0.0, 0, 200), 900, 0.0, cap=4).max_num_seqs == 4
    assert ctl.admit(new, running(4, 0.0, 0, 200), 1200, 0.0).max_num_seqs is None


def test_admit_keeps_the_cap_when_the_seat_would_cost_more_requests_their_tpot_than_it_saves():
    ctl = controller()
    # 100 ms of slack each: one more sequence (+1.1 ms a step over 200 steps) breaks all four
    tight = running(4, 0.0, 100, 200)
    now_s = (50.0 * 300 - 200 * machine_ms(4, 0, 1200) - 100.0) / 1000
    assert ctl.admit([QueuedPrompt("new", now_s, 200)], tight, 1200, now_s, cap=4).max_num_seqs == 4


class QueueEngine:
    """The surface AdaptiveLimits uses: a queue of prompts (a long one first, past saving) and
    four running decodes."""

    class config:
        max_num_seqs = 256

    last_step = None

    def __init__(self, now_s: float) -> None:
        self.waiting = [("late", 0.0, 3000, 16), ("a", now_s, 60, 16), ("b", now_s, 60, 16)]
        self.limits: list[int] = []
        self.orders: list[list[str]] = []

    def prompts(self, waiting: bool = True) -> list:
        return list(self.waiting) if waiting else []

    def running_decodes(self) -> list:
        return [(f"d{i}", 100, 5, 100) for i in range(4)]

    def decode_load(self) -> tuple[int, int]:
        return 4, 420

    def prefill_backlog(self) -> list:
        return []

    def reorder_waiting(self, keys: list[str]) -> None:
        self.orders.append(keys)

    def set_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.limits.append(max_num_seqs)


def adaptive_limits(fixed_cap=None):
    from ferry.engine.adaptive import AdaptiveLimits

    limits = AdaptiveLimits(SloTargets(tpot_ms=50.0, ttft_ms=2000.0), fixed_cap=fixed_cap)
    for i in range(400):
        seqs, prefill, context = 1 + i % 37, (i * 37) % 700, (1 + i % 37) * (20 + (i * 13) % 500)
        limits.model.observe(StepRecord(seqs, prefill, context, machine_ms(seqs, prefill, context)))
    return limits


def test_a_fixed_cap_keeps_the_slo_admission_order_but_never_moves():
    now_s = 1.9
    held, engine = adaptive_limits(fixed_cap=6), QueueEngine(now_s)
    for step in range(5):
        held.before_step(engine, now_s + step * 0.02)
    assert engine.limits == [6] * 5  # no plan, no seats beyond it
    assert engine.orders and all(order[-1] == "late" for order in engine.orders)  # the admission still reorders
    free, engine = adaptive_limits(), QueueEngine(now_s)
    free.before_step(engine, now_s)
    assert engine.limits[0] != 6  # the same state, adaptive: the controller's own cap
    with pytest.raises(ValueError, match="fixed_cap"):
        adaptive_limits(fixed_cap=0)

"""SLO-aware admission: on-time ordering of the queue, TPOT slack, and the controller's admit()."""

import pytest

from ferry.slo import (
    ControllerLimits,
    QueuedPrompt,
    RunningDecode,
    SloController,
    SloTargets,
    StepRecord,
    StepTimeModel,
    on_time_order,
    tpot_slack_ms,
)

pytestmark = pytest.mark.unit


def ms_per_token(tokens):
    return 1.0 * tokens  # 1 ms a prompt token


def keys(prompts):
    return [p.key for p in prompts]


def test_everyone_on_time_keeps_arrival_order():
    queue = [QueuedPrompt("b", 0.2, 100), QueuedPrompt("a", 0.1, 100), QueuedPrompt("c", 0.3, 100)]
    on_time, late = on_time_order(queue, now_s=0.3, deadline_s=1.0, prefill_ms=ms_per_token)
    assert keys(on_time) == ["a", "b", "c"] and late == []


def test_a_long_prompt_that_would_make_the_rest_late_goes_behind_them():
    # FCFS: the 900-token prompt ends at 0.9 s, the three short ones behind it at 1.0-1.2 s > 1 s.
    queue = [QueuedPrompt("long", 0.0, 900), *(QueuedPrompt(f"s{i}", 0.0, 100) for i in range(3))]
    on_time, late = on_time_order(queue, now_s=0.0, deadline_s=1.0, prefill_ms=ms_per_token)
    assert keys(on_time) == ["s0", "s1", "s2"] and keys(late) == ["long"]


def test_prompts_past_their_deadline_are_late_and_do_not_count_against_others():
    queue = [QueuedPrompt("old", 0.0, 50), QueuedPrompt("new", 4.5, 400)]
    on_time, late = on_time_order(queue, now_s=5.0, deadline_s=1.0, prefill_ms=ms_per_token)
    assert keys(on_time) == ["new"] and keys(late) == ["old"]


def test_work_already_ahead_counts():
    queue = [QueuedPrompt("a", 0.0, 300), QueuedPrompt("b", 0.0, 300)]
    on_time, late = on_time_order(queue, 0.0, 1.0, ms_per_token, head_ms=500.0)
    assert keys(on_time) == ["a"] and keys(late) == ["b"]


def test_the_most_prompts_make_it_moore_hodgson():
    """Deadline order with the longest dropped on each miss: the most on time (checked by brute force)."""
    import itertools

    queue = [QueuedPrompt(str(i), t, n) for i, (t, n) in enumerate([(0, 300), (0.1, 500), (0.2, 100), (0.3, 200)])]
    on_time, _ = on_time_order(queue, 0.3, 0.8, ms_per_token)
    best = 0
    for r in range(len(queue) + 1):
        for subset in itertools.combinations(queue, r):
            end, fine = 300.0, True
            for p in subset:
                end += p.num_tokens
                fine &= end <= (p.arrival_s + 0.8) * 1000
            best = max(best, r if fine else 0)
    assert len(on_time) == best == 3


def test_slack_is_the_tightest_live_decode():
    decodes = [
        RunningDecode("loose", first_token_s=0.0, num_after_first=10, num_remaining=10),  # 1000 - 200 - 100 = 700
        RunningDecode("tight", first_token_s=0.0, num_after_first=10, num_remaining=2),  # 600 - 200 - 20 = 380
        RunningDecode("lost", first_token_s=0.0, num_after_first=1, num_remaining=1),  # 100 - 200 - 10 < 0
    ]
    assert tpot_slack_ms(decodes, now_s=0.2, tpot_ms=50.0, decode_step_ms=10.0) == pytest.approx(380.0)
    assert tpot_slack_ms(decodes[2:], 0.2, 50.0, 10.0) is None
    assert tpot_slack_ms([], 0.2, 50.0, 10.0) is None


def machine_ms(seqs, prefill, context):
    return 5.0 + 0.5 * seqs + 20.0 * prefill / 100 + 3.0 * context / 1000


def controller(**limits):
    model = StepTimeModel(forgetting=1.0)
    for i in range(400):
        seqs, prefill, context = 1 + i % 37, (i * 37) % 700, (1 + i % 37) * (20 + (i * 13) % 500)
        model.observe(StepRecord(seqs, prefill, context, machine_ms(seqs, prefill, context)))
    return SloController(model, SloTargets(tpot_ms=50.0, ttft_ms=2000.0), ControllerLimits(**limits))


def test_admit_chunk_follows_the_tpot_slack_of_the_running_decodes():
    ctl = controller()
    roomy = [RunningDecode("a", 0.0, 0, 60)]  # just started: 60 x (50 - decode step) of slack
    tight = [RunningDecode("a", 0.0, 50, 10)]  # 2.9 s spent on 50 tokens: ~20 ms left for 10 more
    wide = ctl.admit([], roomy, 500, now_s=0.0).chunk_tokens
    narrow = ctl.admit([], tight, 500, now_s=2.9).chunk_tokens
    decode = machine_ms(1, 0, 500)
    slack = 60 * (50 - decode)
    assert machine_ms(2, wide, 500) <= decode + 0.5 * slack + 1.0  # the model's fit is close, not exact
    assert machine_ms(2, narrow, 500) <= decode + 0.5 * (3000 - 2900 - 10 * decode) + 1.0
    assert 0 < narrow < wide / 10


def test_admit_raises_the_chunk_for_on_time_prompts_and_orders_the_late_behind():
    ctl = controller()
    tight = [RunningDecode("d", 0.0, 50, 10)]  # no slack: only the TTFT need moves prefill
    queue = [QueuedPrompt("stale", 0.0, 300), QueuedPrompt("fresh", 2.8, 300)]
    decision = ctl.admit(queue, tight, 500, now_s=2.9)
    assert keys(decision.order) == ["fresh", "stale"] and decision.num_late == 1
    assert decision.chunk_tokens > ctl.limits.min_chunk_tokens  # fresh needs its 300 tokens within ~1.6 s


def test_admit_with_nothing_running_takes_the_ttft_ceiling_and_before_the_model_the_fixed_budget():
    ctl = controller()
    assert ctl.admit([QueuedPrompt("a", 0.0, 100)], [], 0, 0.0).chunk_tokens == ctl.chunk_budget(0, 0)
    cold = SloController(StepTimeModel(), SloTargets(), ControllerLimits(fixed_chunk_tokens=512))
    decision = cold.admit([QueuedPrompt("b", 1.0, 10), QueuedPrompt("a", 0.0, 10)], [], 0, 50.0)
    assert decision.chunk_tokens == 512 and keys(decision.order) == ["b", "a"] and decision.num_late == 0


def test_bad_shares_name_the_field():
    with pytest.raises(ValueError, match="slack_share"):
        ControllerLimits(slack_share=0)
    with pytest.raises(ValueError, match="on_time_share"):
        ControllerLimits(on_time_share=1.5)

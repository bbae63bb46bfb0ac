"""SLO controller: the largest cap and chunk within the targets, and replicas from the forecast."""

import subprocess
import sys

import pytest

from ferry.slo import ControllerLimits, SloController, SloTargets, StepRecord, StepTimeModel, TokenMix

pytestmark = pytest.mark.unit


def machine_ms(seqs, prefill, context):
    return 5.0 + 0.5 * seqs + 4.0 * prefill / 100 + 3.0 * context / 1000


def trained(noise=False):
    model = StepTimeModel(forgetting=1.0)
    for i in range(400):
        seqs, prefill, context = 1 + i % 97, (i * 37) % 700, (1 + i % 97) * (20 + (i * 13) % 500)
        model.observe(StepRecord(seqs, prefill, context, machine_ms(seqs, prefill, context)))
    return model


def test_cap_is_the_largest_batch_whose_step_meets_tpot():
    ctl = SloController(trained(), SloTargets(tpot_ms=40.0))
    mix = TokenMix(mean_prompt_tokens=100, mean_output_tokens=100)
    plan = ctl.decode_plan(mix)
    step = lambda b: machine_ms(b, b, b * 150)  # noqa: E731  (prefill share 1 token per seq per step)
    assert step(plan.max_num_seqs) <= 40.0 < step(plan.max_num_seqs + 1)
    assert plan.capacity_rps == pytest.approx(plan.max_num_seqs / 100 / (plan.predicted_step_ms / 1000), rel=1e-6)


def test_longer_contexts_and_tighter_targets_lower_the_cap():
    ctl = SloController(trained(), SloTargets(tpot_ms=40.0))
    short = ctl.decode_plan(TokenMix(100, 100)).max_num_seqs
    long = ctl.decode_plan(TokenMix(1500, 100)).max_num_seqs
    tight = SloController(ctl.model, SloTargets(tpot_ms=15.0)).decode_plan(TokenMix(100, 100)).max_num_seqs
    assert long < short and tight < short


def test_chunk_budget_shrinks_as_decodes_fill_the_step():
    ctl = SloController(trained(), SloTargets(tpot_ms=40.0, ttft_ms=400.0), ControllerLimits(max_itl_factor=1.0))
    few, many = ctl.chunk_budget(2, 400), ctl.chunk_budget(20, 20 * 200)
    assert many < few
    assert machine_ms(21, many, 4000) <= 40.0 < machine_ms(21, many + 8, 4000)  # within a few tokens
    alone = ctl.chunk_budget(0, 0)  # nobody decoding: only TTFT counts, half of it per step
    assert machine_ms(1, alone, 0) <= 200.0 or alone == ctl.limits.max_chunk_tokens
    tiny = ctl.chunk_budget(24, 24 * 300)  # the decodes leave room for ~22 tokens only
    assert ctl.limits.min_chunk_tokens <= tiny <= 24  # prefill still moves
    hopeless = ctl.chunk_budget(60, 60 * 500)  # the decodes alone take 125 ms: no prefill can be deferred
    assert hopeless == ctl.limits.min_chunk_tokens  # ... and none waits
    due = ctl.chunk_budget(60, 60 * 500, backlog=[(0.0, 3000)], now_s=0.0)  # 3000 tokens due in 200 ms
    assert due == 750  # 4 steps at the TPOT pace before the deadline
    flood = ctl.chunk_budget(60, 60 * 500, backlog=[(0.0, 30000)], now_s=0.0)
    assert machine_ms(61, flood, 30000) <= 200.0 < machine_ms(61, flood + 8, 30000)  # never past half the TTFT


def test_prompts_near_their_ttft_deadline_get_the_chunk_they_need():
    limits = ControllerLimits(max_itl_factor=1.0)  # deferrable prefill: only what fits in the TPOT target
    ctl = SloController(trained(), SloTargets(tpot_ms=40.0, ttft_ms=2000.0), limits)  # deadline: 1 s, 25 steps
    assert ctl.ttft_chunk([], 10.0) == 0
    assert ctl.ttft_chunk([(9.9, 500)], 10.0) == 24  # 500 tokens in 21.5 steps
    assert ctl.ttft_chunk([(9.9, 500), (10.0, 1000)], 10.0) == 63  # 1500 tokens by the second's deadline
    assert ctl.ttft_chunk([(5.0, 300), (10.0, 1000)], 10.0) == 55  # the lost one is not chased, still first
    relaxed = ctl.chunk_budget(20, 4000)
    pressed = ctl.chunk_budget(20, 4000, backlog=[(9.9, 500), (10.0, 9000)], now_s=10.0)
    assert pressed == 396 > relaxed  # 9500 tokens in 24 steps: TTFT now outweighs the deferral


def test_an_infeasible_target_takes_the_smallest_cap_and_says_so():
    ctl = SloController(trained(), SloTargets(tpot_ms=6.0), ControllerLimits(fixed_num_seqs=24))
    plan = ctl.decode_plan(TokenMix(100, 100))  # even 4 sequences take > 6 ms a step here
    assert (plan.max_num_seqs, plan.is_feasible, plan.capacity_rps) == (4, False, 0.0)
    assert ctl.desired_replicas(50.0, plan, current=2) == 2


def test_fixed_limits_until_the_model_is_ready():
    ctl = SloController(StepTimeModel(), SloTargets(), ControllerLimits(fixed_num_seqs=48, fixed_chunk_tokens=512))
    plan = ctl.decode_plan(TokenMix())
    assert (plan.max_num_seqs, plan.is_model_ready) == (48, False)
    assert ctl.chunk_budget(10, 1000) == 512
    assert ctl.desired_replicas(100.0, plan, current=3) == 3


def test_desired_replicas_follow_the_forecast():
    ctl = SloController(trained(), SloTargets(tpot_ms=40.0), ControllerLimits(target_utilization=0.5))
    plan = ctl.decode_plan(TokenMix(100, 100))
    one = plan.capacity_rps
    assert ctl.desired_replicas(0.0, plan, current=4) == 1
    assert ctl.desired_replicas(0.5 * one, plan, current=1) == 1
    assert ctl.desired_replicas(2.1 * one, plan, current=1) == 5
    prefill = ctl.prefill_plan(TokenMix(500, 50))
    assert prefill.capacity_rps > 0 and prefill.chunk_tokens >= ctl.limits.min_chunk_tokens


def test_bad_targets_name_the_field():
    with pytest.raises(ValueError, match="tpot_ms"):
        SloTargets(tpot_ms=0)
    with pytest.raises(ValueError, match="min_num_seqs"):
        ControllerLimits(min_num_seqs=0)


def test_the_slo_package_is_pure():
    code = "import sys, ferry.slo; print(sorted(m for m in ('torch', 'nats', 'redis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_step_with_prefill_may_take_a_few_tpot_targets():
    """max_itl_factor: how far a step carrying deferrable prefill may stretch past the TPOT target."""
    model = trained()
    one = SloController(model, SloTargets(tpot_ms=40.0), ControllerLimits(max_itl_factor=1.0)).chunk_budget(10, 2000)
    two = SloController(model, SloTargets(tpot_ms=40.0), ControllerLimits(max_itl_factor=2.0)).chunk_budget(10, 2000)
    assert machine_ms(11, two, 2000) <= 80.0 < machine_ms(11, two + 8, 2000)
    assert two > 2 * one


def test_the_cap_keeps_room_for_what_the_arrivals_keep_running_below_capacity_only():
    # documents: at 6 req/s (capacity ~6.5) the arrivals keep ~1.5 x 10 running in bursts, and the
    # cap is raised for them (within the decode-only cap); at 12 req/s (overloaded) it is not:
    # what the cap in target cannot take queues (test_slo_overload.py)
    model, targets = trained(), SloTargets(tpot_ms=40.0)
    ctl, prefill_only = (
        SloController(model, targets),
        SloController(model, targets, ControllerLimits(arrival_headroom=0)),
    )
    mix = TokenMix(mean_prompt_tokens=700, mean_output_tokens=40)
    decode_only = max(b for b in range(4, 257) if machine_ms(b, 0, b * mix.mean_context_tokens) <= 40.0)
    held, busy = prefill_only.decode_plan(mix, True, 6.0), ctl.decode_plan(mix, True, 6.0)
    assert not busy.is_overloaded and 6.0 <= busy.capacity_rps == held.capacity_rps
    assert held.max_num_seqs < busy.max_num_seqs <= decode_only  # raised, but never past a decode-only step
    over = ctl.decode_plan(mix, True, 12.0)
    assert over.is_overloaded and over.capacity_rps < 12.0  # the role still says it needs more replicas
    assert over.max_num_seqs == prefill_only.decode_plan(mix, True, 12.0).max_num_seqs < busy.max_num_seqs
    light = ctl.decode_plan(mix, True, 0.2)  # a light load keeps ~1 running: the cap is the planned one
    assert light.max_num_seqs == prefill_only.decode_plan(mix, True, 0.2).max_num_seqs

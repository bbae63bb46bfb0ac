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
    ctl = SloController(trained(), SloTargets(tpot_ms=40.0, ttft_ms=400.0))
    few, many = ctl.chunk_budget(2, 400), ctl.chunk_budget(20, 20 * 200)
    assert many < few
    assert machine_ms(21, many, 4000) <= 40.0 < machine_ms(21, many + 8, 4000)  # within a few tokens
    alone = ctl.chunk_budget(0, 0)  # nobody decoding: only TTFT counts, half of it per step
    assert machine_ms(1, alone, 0) <= 200.0 or alone == ctl.limits.max_chunk_tokens
    hopeless = ctl.chunk_budget(90, 90 * 1000)
    assert hopeless == ctl.limits.min_chunk_tokens  # prefill always moves


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

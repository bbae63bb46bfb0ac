"""CapSmoother: hysteresis on the planned cap (no flapping step to step)."""

import pytest

from ferry.engine.adaptive import AdaptiveLimits
from ferry.slo import CapSmoother, ControllerLimits, SloTargets, StepRecord, TokenMix

pytestmark = pytest.mark.unit


def run(smoother: CapSmoother, plans: list[int]) -> list[int]:
    return [smoother.update(p) for p in plans]


def test_a_plan_flapping_between_two_values_leaves_the_cap_where_it_was():
    caps = run(CapSmoother(band=0.15, hold_steps=4), [32, 120, 32, 120, 32, 120, 32, 120, 32])
    assert set(caps) == {32}  # the plan alone would have moved the cap 8 times
    caps = run(CapSmoother(band=0.15, hold_steps=4), [60, 30, 90, 30, 90, 30, 90, 30, 90])
    assert set(caps) == {60}  # either side in turn: the count starts again every time


def test_jitter_within_the_band_is_ignored():
    caps = run(CapSmoother(band=0.15, hold_steps=1), [40, 44, 37, 46, 35, 41])
    assert set(caps) == {40}
    assert run(CapSmoother(band=0.0, hold_steps=1), [3, 4, 2]) == [3, 3, 3]  # at least 1 sequence


def test_a_sustained_change_moves_the_cap_after_hold_steps_to_the_nearest_plan():
    smoother = CapSmoother(band=0.15, hold_steps=4)
    caps = run(smoother, [100, 40, 35, 45, 30, 30])
    assert caps == [100, 100, 100, 100, 45, 45]  # down after 4 plans below the band, to the nearest of them
    caps = run(smoother, [80, 90, 200, 70, 70])
    assert caps == [45, 45, 45, 70, 70]  # up: the one spike (200) does not set the cap


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="band"):
        CapSmoother(band=1.5)
    with pytest.raises(ValueError, match="hold_steps"):
        CapSmoother(hold_steps=0)
    with pytest.raises(ValueError, match="planned"):
        CapSmoother().update(0)
    with pytest.raises(ValueError, match="cap_hold_steps"):
        ControllerLimits(cap_hold_steps=0)
    with pytest.raises(ValueError, match="cap_band"):
        ControllerLimits(cap_band=-0.1)


class FakeEngine:
    """The surface AdaptiveLimits uses, with nothing waiting or running."""

    class config:
        max_num_seqs = 64

    last_step = None

    def __init__(self) -> None:
        self.limits: list[int] = []

    def prompts(self, waiting: bool = True) -> list:
        return []

    def running_decodes(self) -> list:
        return []

    def decode_load(self) -> tuple[int, int]:
        return 0, 0

    def prefill_backlog(self) -> list:
        return []

    def set_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.limits.append(max_num_seqs)


def test_adaptive_limits_smooth_a_plan_that_flips_between_loaded_and_overloaded():
    def machine_ms(seqs, prefill, context):  # test_slo_controller's synthetic machine
        return 5.0 + 0.5 * seqs + 4.0 * prefill / 100 + 3.0 * context / 1000

    limits = AdaptiveLimits(SloTargets(tpot_ms=40.0), keep_history=True, admission=False)
    for i in range(400):
        seqs, prefill, context = 1 + i % 97, (i * 37) % 700, (1 + i % 97) * (20 + (i * 13) % 500)
        limits.model.observe(StepRecord(seqs, prefill, context, machine_ms(seqs, prefill, context)))
    engine, mix = FakeEngine(), TokenMix(700, 40)
    for step in range(12):  # the forecast flips across capacity (~6.5 req/s) every step
        limits.set_forecast(mix, 6.0 if step % 2 else 12.0)
        limits.before_step(engine, now_s=step * 0.04)
    planned = [h.planned_num_seqs for h in limits.history]
    assert len(set(planned)) == 2  # the plan flips (raised below capacity, held above)
    assert len(set(engine.limits)) == 1 and engine.limits == [h.max_num_seqs for h in limits.history]

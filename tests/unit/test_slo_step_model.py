"""The step-time model: recursive least squares recovers a machine's costs and follows changes."""

import random

import pytest

from ferry.slo import StepRecord, StepTimeModel
from ferry.slo.step_model import z_score

pytestmark = pytest.mark.unit


def true_ms(seqs, prefill, context, scale=1.0):
    return scale * (5.0 + 0.4 * seqs + 3.0 * prefill / 100 + 2.0 * context / 1000)


def random_step(rng, scale=1.0, noise_ms=0.0):
    seqs = rng.randint(1, 64)
    prefill = rng.choice([0, 0, rng.randint(1, 512)])
    context = seqs * rng.randint(16, 600)
    ms = true_ms(seqs, prefill, context, scale) + rng.gauss(0, noise_ms)
    return StepRecord(seqs, prefill, context, max(ms, 0.0))


def test_recovers_the_costs_of_a_noiseless_machine():
    rng, model = random.Random(0), StepTimeModel(forgetting=1.0)
    for _ in range(200):
        model.observe(random_step(rng))
    coef = model.snapshot()["coefficients_ms"]
    assert coef["overhead"] == pytest.approx(5.0, abs=1e-3)
    assert coef["per_seq"] == pytest.approx(0.4, abs=1e-4)
    assert coef["per_100_prefill_tokens"] == pytest.approx(3.0, abs=1e-3)
    assert coef["per_1000_context_tokens"] == pytest.approx(2.0, abs=1e-3)
    assert model.predict_ms(StepRecord(32, 0, 32 * 300)) == pytest.approx(true_ms(32, 0, 9600), rel=1e-4)


def test_the_quantile_adds_the_noise_it_measured():
    rng, model = random.Random(1), StepTimeModel()
    for _ in range(2000):
        model.observe(random_step(rng, noise_ms=2.0))
    assert model.residual_ms == pytest.approx(2.0, rel=0.25)
    probe = StepRecord(16, 0, 16 * 200)
    gap = model.predict_ms(probe, quantile=0.9) - model.predict_ms(probe)
    assert gap == pytest.approx(1.2816 * model.residual_ms, rel=1e-3)


def test_follows_a_machine_that_slows_down():
    rng, model = random.Random(2), StepTimeModel(forgetting=0.98)
    for _ in range(300):
        model.observe(random_step(rng))
    for _ in range(300):  # a noisy neighbour: every step twice as slow
        model.observe(random_step(rng, scale=2.0))
    assert model.predict_ms(StepRecord(32, 0, 6400)) == pytest.approx(true_ms(32, 0, 6400, 2.0), rel=0.02)


def test_costs_never_go_negative_even_with_collinear_features():
    model = StepTimeModel()
    for seqs in range(1, 60):  # context exactly proportional to batch: the split is ambiguous
        model.observe(StepRecord(seqs, 0, seqs * 100, 4.0 + 0.5 * seqs))
    assert all(c >= 0 for c in model.coefficients[1:])
    predictions = [model.predict_ms(StepRecord(b, 0, b * 100)) for b in (1, 8, 32, 64)]
    assert predictions == sorted(predictions)


def test_not_ready_until_min_observations():
    model = StepTimeModel(min_observations=3)
    for _ in range(3):
        assert not model.is_ready
        model.observe(StepRecord(1, 0, 10, 5.0))
    assert model.is_ready and model.snapshot()["num_observations"] == 3


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="num_seqs"):
        StepRecord(-1, 0, 0, 1.0)
    with pytest.raises(ValueError, match="duration_ms"):
        StepRecord(1, 0, 0, float("nan"))
    with pytest.raises(ValueError, match="quantile"):
        z_score(1.0)
    with pytest.raises(ValueError, match="forgetting"):
        StepTimeModel(forgetting=0.5)

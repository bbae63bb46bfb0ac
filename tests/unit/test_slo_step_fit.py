"""The capacity probe's step fit: non-negative costs, outliers dropped, a robust spread; and the
probe's phases, which vary batch size, prefill and context apart."""

import random

import pytest

from ferry.bench.slo_capacity import PROBE_DECODE_BATCHES, PROBE_PREFILL_FRACTIONS, probe_phases
from ferry.bench.workload import WorkloadRequest
from ferry.slo import StepRecord, StepTimeModel
from ferry.slo.step_fit import fit_steps, nnls

pytestmark = pytest.mark.unit

TRUE = (6.0, 0.3, 50.0, 4.0)  # overhead, per seq, per 100 prefill tokens, per 1000 context tokens


def step(seqs, prefill, context, rng, noise_ms=1.0, extra_ms=0.0):
    ms = TRUE[0] + TRUE[1] * seqs + TRUE[2] * prefill / 100 + TRUE[3] * context / 1000
    return StepRecord(seqs, prefill, context, max(ms + rng.gauss(0, noise_ms) + extra_ms, 0.0))


def all_at_once_steps(rng):
    """24 document prompts at once: prefill steps of ~3 prompts, then a shrinking batch whose
    context shrinks with it (batch size and context collinear)."""
    steps = [step(3, 2048, 0, rng) for _ in range(8)]
    steps += [step(b, 0, b * 720, rng) for b in range(24, 0, -1) for _ in range(2)]
    return steps


def probe_like_steps(rng):
    steps = all_at_once_steps(rng)
    steps += [step(b, 0, b * 12, rng) for b in PROBE_DECODE_BATCHES for _ in range(11)]
    steps += [step(1, int(700 * f), 0, rng) for f in PROBE_PREFILL_FRACTIONS]
    return steps


def test_recovers_the_costs_from_the_probes_phases_despite_slow_steps():
    rng = random.Random(1)
    steps = probe_like_steps(rng)
    steps[5] = StepRecord(steps[5].num_seqs, steps[5].num_prefill_tokens, steps[5].num_context_tokens, 400.0)
    steps[40] = StepRecord(steps[40].num_seqs, 0, steps[40].num_context_tokens, steps[40].duration_ms + 60)
    fit = fit_steps(steps)
    for got, want, tol in zip(fit.coefficients, TRUE, (1.5, 0.15, 2.0, 1.5)):
        assert got == pytest.approx(want, abs=tol)
    assert fit.num_outliers >= 2
    assert fit.residual_ms < 2.0  # the two slow steps do not inflate the spread the p90 plans with


def test_costs_never_come_out_negative_and_the_fit_is_the_constrained_optimum():
    """A machine with no fixed overhead and noisy steps: plain least squares gives a negative
    overhead; the fit clamps it at 0 and no direction into c >= 0 lowers its squared error."""
    rng = random.Random(3)
    rows = []
    for b in range(1, 30):
        ms = 0.8 * b + 2.0 * b * 700 / 1000 + rng.gauss(0, 3.0)
        rows.append(([1.0, float(b), 0.0, b * 0.7], ms))
    coefs = nnls(rows)
    assert min(coefs) >= 0
    grad = [sum(-2 * (y - sum(c * v for c, v in zip(coefs, x))) * x[i] for x, y in rows) for i in range(4)]
    for c, g in zip(coefs, grad):
        assert g >= -1e-6 * len(rows)  # KKT: a zero coefficient's gradient points out of the set
        if c > 0:
            assert abs(g) < 1e-6 * len(rows) * 100


def test_a_fitted_model_predicts_with_its_coefficients_and_spread():
    model = StepTimeModel.with_coefficients(list(TRUE), 2.0, 50)
    assert model.is_ready
    record = StepRecord(10, 200, 5000)
    assert model.predict_ms(record) == pytest.approx(6.0 + 3.0 + 100.0 + 20.0)
    assert model.predict_ms(record, 0.9) == pytest.approx(129.0 + 1.2816 * 2.0, abs=1e-3)
    with pytest.raises(ValueError, match="coefficients"):
        StepTimeModel.with_coefficients([1.0, 2.0], 1.0, 10)


def test_too_few_steps_to_fit_is_an_error():
    with pytest.raises(ValueError, match="need at least 4"):
        fit_steps([StepRecord(1, 0, 0, 5.0)] * 3)


def test_the_probe_varies_batch_size_prefill_and_context_apart():
    rng = random.Random(0)
    requests = [WorkloadRequest(i, [rng.randrange(1000) for _ in range(rng.randint(50, 900))], 36) for i in range(24)]
    phases = probe_phases(requests)
    assert [len(p) for p in phases[1 : 1 + len(PROBE_DECODE_BATCHES)]] == list(PROBE_DECODE_BATCHES)
    assert all(len(prompt) <= 8 for phase in phases[1 : 1 + len(PROBE_DECODE_BATCHES)] for prompt, _ in phase)
    lone = phases[1 + len(PROBE_DECODE_BATCHES) :]
    longest = max(len(r.prompt_token_ids) for r in requests)
    assert [len(p) for p in lone] == [1] * len(PROBE_PREFILL_FRACTIONS)
    assert [len(p[0][0]) for p in lone] == [int(longest * f) for f in PROBE_PREFILL_FRACTIONS]
    assert phases[0] == [(r.prompt_token_ids, r.max_tokens) for r in requests]


def test_the_spread_covers_the_p90_of_the_steps_slow_ones_included():
    """15 % of the steps 20 ms slow (another process): the coefficients stay the machine's, and the
    p90 the controller plans with still covers 90 % of the steps."""
    rng = random.Random(2)
    steps = probe_like_steps(rng)
    for i in range(0, len(steps), 7):
        s = steps[i]
        steps[i] = StepRecord(s.num_seqs, s.num_prefill_tokens, s.num_context_tokens, s.duration_ms + 20.0)
    fit = fit_steps(steps)
    assert fit.coefficients[0] == pytest.approx(TRUE[0], abs=1.5)
    model = fit.to_model()
    covered = sum(s.duration_ms <= model.predict_ms(s, 0.9) + 1e-9 for s in steps)
    assert covered >= 0.9 * len(steps)
    assert fit.residual_ms > 5.0

"""A one-shot fit of the step-time model to a batch of measured steps: the capacity probe's.

The online model (step_model.StepTimeModel) follows a machine step by step with recursive least
squares, fine over thousands of steps. A probe has a few dozen, and they are the ones the online
fit gets wrong: when batch size, prefill and context grow together, plain least squares trades a
negative overhead for a larger slope, and one slow step (another process, a GC pause) moves every
coefficient. This fit instead:
- is least squares with every coefficient >= 0 (a step cannot cost less than nothing for any part
  of it): with 4 features, the exact non-negative optimum is the best of the 16 unconstrained fits
  on subsets of them whose coefficients all come out >= 0;
- drops outliers one at a time, the worst first, while it lies more than OUTLIER_SIGMAS robust
  deviations off the fit of the rest (dropping all the first fit flags at once also dropped
  good steps that one far outlier had dragged the fit away from);
- gives the spread so that the controller's p90 covers the probe's own p90 error, outliers
  included (a robust deviation alone, 0.6 ms in a trial, left the probe planning with a far
  smaller margin than the run's online model, 11 ms); one very slow step moves a quantile no
  more than one place, where it would blow up a variance.
Pure Python, no torch.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from ferry.slo.step_model import FEATURE_NAMES, StepRecord, StepTimeModel, z_score

OUTLIER_SIGMAS = 4.0
MAX_OUTLIER_SHARE = 0.2
"""At most this share of the steps is dropped: beyond it the spread is the machine's, not a few steps'."""
SPREAD_QUANTILE = 0.9
MAD_TO_SIGMA = 1.4826
"""A normal variable's standard deviation over its median absolute deviation."""


@dataclass(slots=True, frozen=True)
class StepFit:
    """Non-negative step-time coefficients (ms per unit of StepRecord.features()) and their spread."""

    coefficients: tuple[float, ...]
    residual_ms: float
    """The spread a quantile plans with: at least the robust deviation of all steps' errors, and
    enough that the mean plus z(SPREAD_QUANTILE) of it covers that quantile of them (the slow
    steps left out of the coefficients still happen: at p90 they count)."""
    num_steps: int
    """Steps kept in the final fit."""
    num_outliers: int
    """Steps dropped as outliers."""

    def to_model(self) -> StepTimeModel:
        return StepTimeModel.with_coefficients(list(self.coefficients), self.residual_ms, self.num_steps)

    def snapshot(self) -> dict:
        return {
            "coefficients_ms": dict(zip(FEATURE_NAMES, (round(c, 4) for c in self.coefficients))),
            "residual_ms": round(self.residual_ms, 4),
            "num_steps": self.num_steps,
            "num_outliers": self.num_outliers,
        }


def fit_steps(records: list[StepRecord]) -> StepFit:
    """The non-negative least-squares step model of `records`, refitted without its outliers."""
    if len(records) < len(FEATURE_NAMES):
        raise ValueError(f"fit_steps: {len(records)} steps, need at least {len(FEATURE_NAMES)}")
    rows = [(r.features(), r.duration_ms) for r in records]
    max_outliers = int(MAX_OUTLIER_SHARE * len(rows))
    coefs = nnls(rows)
    while len(records) - len(rows) < max_outliers:
        errors = [abs(y - _dot(coefs, x)) for x, y in rows]
        worst = max(range(len(rows)), key=errors.__getitem__)
        if errors[worst] <= OUTLIER_SIGMAS * _robust_sigma(errors, centred=True):
            break
        del rows[worst]  # one at a time: a far outlier drags the fit, flagging good steps with it
        coefs = nnls(rows)
    errors = [r.duration_ms - _dot(coefs, r.features()) for r in records]  # the outliers' too
    spread = max(_robust_sigma(errors), _quantile(errors, SPREAD_QUANTILE) / z_score(SPREAD_QUANTILE))
    return StepFit(tuple(coefs), max(spread, 0.0), len(rows), len(records) - len(rows))


def nnls(rows: list[tuple[list[float], float]]) -> list[float]:
    """argmin ||X c - y|| over c >= 0, exactly, for a handful of features (every active set)."""
    n = len(rows[0][0])
    best: tuple[float, list[float]] = (_sse(rows, [0.0] * n), [0.0] * n)
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            sub = _least_squares([([x[i] for i in subset], y) for x, y in rows])
            if sub is None or min(sub) < 0:
                continue
            coefs = [0.0] * n
            for i, c in zip(subset, sub):
                coefs[i] = c
            sse = _sse(rows, coefs)
            if sse < best[0]:
                best = (sse, coefs)
    return best[1]


def _least_squares(rows: list[tuple[list[float], float]]) -> list[float] | None:
    """Unconstrained least squares by the normal equations; None when they are singular."""
    n = len(rows[0][0])
    a = [[sum(x[i] * x[j] for x, _ in rows) for j in range(n)] for i in range(n)]
    b = [sum(x[i] * y for x, y in rows) for i in range(n)]
    return _solve(a, b)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (n <= 4); None for a (near-)singular system."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * max(scale, 1e-300):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * p for v, p in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _robust_sigma(errors: list[float], centred: bool = False) -> float:
    """MAD_TO_SIGMA x the median absolute deviation; centred: `errors` are already |deviations|."""
    median = 0.0 if centred else statistics.median(errors)
    return MAD_TO_SIGMA * statistics.median(abs(e - median) for e in errors)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _sse(rows: list[tuple[list[float], float]], coefs: list[float]) -> float:
    return sum((y - _dot(coefs, x)) ** 2 for x, y in rows)


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))

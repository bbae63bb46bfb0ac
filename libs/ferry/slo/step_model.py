"""A worker's step-time model, learned online from its own steps.

One engine step costs roughly a fixed overhead (weights read once, Python, kernel launches), plus
a share per decoding sequence, per prefill token and per context token its attention reads:

    step_ms ~ c0 + c1 * num_seqs + c2 * num_prefill_tokens / 100 + c3 * num_context_tokens / 1000

The coefficients are fitted by recursive least squares with a forgetting factor, so the model
follows the machine (another tenant, a thermal limit) without keeping a history. Predictions use
the slopes clamped at >= 0: collinear features (batch size and total context grow together) can
trade a negative slope for a larger one, and the controller needs step time to grow with the
batch. (Clamping inside the recursion instead, a projection, diverges: the covariance still
describes the unclamped estimate.) The residual's exponentially
weighted variance gives a quantile: predict_ms(features, quantile=0.9). Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

FEATURE_NAMES = ("overhead", "per_seq", "per_100_prefill_tokens", "per_1000_context_tokens")


@dataclass(slots=True, frozen=True)
class StepRecord:
    """What one engine step did and how long it took: what the model learns from."""

    num_seqs: int
    """Sequences in the step (decodes and prefill chunks)."""
    num_prefill_tokens: int
    """Tokens computed for sequences still prefilling (chunks); decodes count in num_seqs only."""
    num_context_tokens: int
    """Tokens already in the cache that the step's attention reads, summed over its sequences."""
    duration_ms: float = 0.0
    """Wall time of the step."""

    def __post_init__(self) -> None:
        for name in ("num_seqs", "num_prefill_tokens", "num_context_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepRecord.{name}={getattr(self, name)}: must be >= 0")
        if not self.duration_ms >= 0:
            raise ValueError(f"StepRecord.duration_ms={self.duration_ms}: must be >= 0")

    def features(self) -> list[float]:
        return [1.0, float(self.num_seqs), self.num_prefill_tokens / 100.0, self.num_context_tokens / 1000.0]


def z_score(quantile: float) -> float:
    """How many standard deviations above the mean a normal variable's `quantile` lies."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile={quantile}: must be in (0, 1)")
    return NormalDist().inv_cdf(quantile)


class StepTimeModel:
    """Recursive least squares on StepRecord.features(); see the module doc."""

    def __init__(
        self, forgetting: float = 0.995, prior_var: float = 1e4, min_observations: int = 8, residual_alpha: float = 0.02
    ) -> None:
        if not 0.9 <= forgetting <= 1.0:
            raise ValueError(f"forgetting={forgetting}: must be in [0.9, 1]")
        n = len(FEATURE_NAMES)
        self.forgetting = forgetting
        self.residual_alpha = residual_alpha
        """EWMA weight of each squared error in the residual variance (~1/alpha recent steps)."""
        self.min_observations = min_observations
        self.theta = [0.0] * n
        self._p = [[prior_var if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.num_observations = 0
        self._resid_var = 0.0

    @classmethod
    def with_coefficients(cls, coefficients: list[float], residual_ms: float, num_observations: int) -> StepTimeModel:
        """A model that predicts with coefficients fitted elsewhere (step_fit: a probe's batch)."""
        if len(coefficients) != len(FEATURE_NAMES):
            raise ValueError(f"coefficients={coefficients}: need one per {FEATURE_NAMES}")
        model = cls(forgetting=1.0)
        model.theta = list(coefficients)
        model._resid_var = residual_ms * residual_ms
        model.num_observations = num_observations
        return model

    @property
    def is_ready(self) -> bool:
        """Enough steps seen for predictions worth acting on."""
        return self.num_observations >= self.min_observations

    @property
    def coefficients(self) -> list[float]:
        """The fitted costs (ms per feature unit), slopes clamped at >= 0."""
        return [self.theta[0]] + [max(t, 0.0) for t in self.theta[1:]]

    @property
    def residual_ms(self) -> float:
        """Standard deviation of recent prediction errors."""
        return math.sqrt(self._resid_var)

    def observe(self, record: StepRecord) -> None:
        x = record.features()
        error = record.duration_ms - _dot(self.theta, x)  # the recursion's own (unclamped) error
        px = [_dot(row, x) for row in self._p]  # P x
        gain_den = self.forgetting + _dot(x, px)
        gain = [v / gain_den for v in px]
        self.theta = [t + g * error for t, g in zip(self.theta, gain)]
        n, lam = len(x), self.forgetting
        self._p = [[(self._p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        if self.num_observations >= self.min_observations:  # errors of a half-fitted model say little
            self._resid_var += self.residual_alpha * (error * error - self._resid_var)
        self.num_observations += 1

    def predict_ms(self, record: StepRecord, quantile: float | None = None) -> float:
        """Predicted duration of a step like `record` (its duration_ms is ignored); with a
        quantile, the mean plus that many residual standard deviations."""
        mean = _dot(self.coefficients, record.features())
        return mean if quantile is None else mean + z_score(quantile) * self.residual_ms

    def snapshot(self) -> dict:
        """For micro stats and metrics: coefficients (ms), residual and how much it has seen."""
        return {
            "coefficients_ms": dict(zip(FEATURE_NAMES, (round(t, 4) for t in self.coefficients))),
            "residual_ms": round(self.residual_ms, 4),
            "num_observations": self.num_observations,
            "is_ready": self.is_ready,
        }


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))

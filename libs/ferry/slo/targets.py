"""What the SLO controller is told (targets, limits, the token mix) and what it answers (a Plan
for the cap and chunk, an Admission for the next step). Pure dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.slo.admission import QueuedPrompt


@dataclass(slots=True, frozen=True)
class SloTargets:
    tpot_ms: float = 50.0
    """Inter-token latency target (FERRY_TPOT_SLO_MS)."""
    ttft_ms: float = 1000.0
    """Time-to-first-token target (FERRY_TTFT_SLO_MS)."""
    quantile: float = 0.9
    """The targets hold for this quantile of steps (p90)."""

    def __post_init__(self) -> None:
        for name in ("tpot_ms", "ttft_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SloTargets.{name}={getattr(self, name)}: must be > 0")
        if not 0.5 <= self.quantile < 1:
            raise ValueError(f"SloTargets.quantile={self.quantile}: must be in [0.5, 1)")


@dataclass(slots=True, frozen=True)
class ControllerLimits:
    """Bounds the controller stays inside, and what applies before the model is ready."""

    min_num_seqs: int = 4
    """The cap never goes below this: a handful of sequences cost about what one does, and a model
    that only ever sees one batch size cannot tell per-sequence cost from overhead."""
    max_num_seqs: int = 256
    min_chunk_tokens: int = 16
    max_chunk_tokens: int = 2048
    fixed_num_seqs: int = 64
    """The cap before the model is ready."""
    fixed_chunk_tokens: int = 2048
    arrival_headroom: float = 1.5
    """decode_plan, not overloaded: the cap is at least this many times the sequences the forecast
    rate keeps running on average (Little's law), within the decode-only cap: Poisson arrivals and
    bursts run above their mean. Overloaded it does not apply (the cap in target serves the most)."""
    cap_band: float = 0.15
    """CapSmoother: a planned cap within this share (and at least 1 sequence) of the cap in force
    leaves it as it is."""
    cap_hold_steps: int = 4
    """CapSmoother: a planned cap outside the band moves the cap only once this many consecutive
    plans lie outside it on the same side (then to the nearest of them)."""
    target_utilization: float = 0.8
    """Replicas are sized so the forecast uses this share of their SLO capacity (queueing room)."""
    max_itl_factor: float = 4.0
    """A step carrying deferrable prefill may take this many TPOT targets (see the module doc)."""
    ttft_deadline_share: float = 0.5
    """Plan prefills to end by this share of the TTFT target: the rest is margin for the model's
    errors and for steps slower than the TPOT pace."""
    on_time_share: float = 0.8
    """admit(): a queued prompt counts as on time when its prefill is predicted to end within this
    share of the TTFT target."""
    slack_share: float = 0.5
    """admit(): a step may use this share of the tightest running request's TPOT slack (prefill
    keeps coming: the rest is for later steps)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_num_seqs <= self.max_num_seqs:
            raise ValueError(f"ControllerLimits.min_num_seqs={self.min_num_seqs}: must be in [1, max_num_seqs]")
        if not 1 <= self.min_chunk_tokens <= self.max_chunk_tokens:
            raise ValueError(
                f"ControllerLimits.min_chunk_tokens={self.min_chunk_tokens}: must be in [1, max_chunk_tokens]"
            )
        if not 0 < self.ttft_deadline_share <= 1:
            raise ValueError(f"ControllerLimits.ttft_deadline_share={self.ttft_deadline_share}: must be in (0, 1]")
        if not self.max_itl_factor >= 1:
            raise ValueError(f"ControllerLimits.max_itl_factor={self.max_itl_factor}: must be >= 1")
        for name in ("on_time_share", "slack_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"ControllerLimits.{name}={getattr(self, name)}: must be in (0, 1]")
        if not 0 <= self.cap_band < 1:
            raise ValueError(f"ControllerLimits.cap_band={self.cap_band}: must be in [0, 1)")
        if not self.cap_hold_steps >= 1:
            raise ValueError(f"ControllerLimits.cap_hold_steps={self.cap_hold_steps}: must be >= 1")
        if not self.arrival_headroom >= 0:
            raise ValueError(f"ControllerLimits.arrival_headroom={self.arrival_headroom}: must be >= 0")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"ControllerLimits.target_utilization={self.target_utilization}: must be in (0, 1]")


@dataclass(slots=True, frozen=True)
class TokenMix:
    mean_prompt_tokens: float = 128.0
    mean_output_tokens: float = 128.0

    @property
    def mean_context_tokens(self) -> float:
        """Context a running sequence holds on average over its life."""
        return self.mean_prompt_tokens + self.mean_output_tokens / 2


@dataclass(slots=True, frozen=True)
class Plan:
    """What the controller chose and why."""

    max_num_seqs: int
    chunk_tokens: int
    """Prefill tokens per step in that steady state (prefill role: its chunk budget)."""
    predicted_step_ms: float
    """The step at that cap, at the target quantile."""
    capacity_rps: float
    """Requests/s one replica serves within the targets."""
    is_model_ready: bool
    is_feasible: bool = True
    """False: not even min_num_seqs meets the TPOT target with the prefill in its steps; the cap is
    then min_num_seqs and capacity_rps is 0."""
    is_overloaded: bool = False
    """The forecast rate is above capacity_rps (or infeasible): the cap is the one whose step holds
    the TPOT target, and what it cannot take queues."""


@dataclass(slots=True, frozen=True)
class Admission:
    """SloController.admit's decision for the next step."""

    order: list[QueuedPrompt]
    """The waiting prompts in the order to admit them: on time first, then the late."""
    num_late: int
    """The last num_late of `order` cannot meet the TTFT target any more."""
    chunk_tokens: int
    """Prefill tokens the step may carry."""
    max_num_seqs: int | None = None
    """The cap for the step: the planned one, raised by the seats that on-time prompts it would
    hold back get (ferry.slo.admission.seats_to_add); None when admit() got no cap."""

"""SLO controller: the largest batch cap and prefill chunk that keep predicted latency in target.

Inputs: the worker's StepTimeModel, the SLO targets and the traffic's token mix (forecast).

- Decode batch cap: the largest number of running sequences b whose steady-state step is
  predicted (at the target quantile) within the TPOT target. A step carries the prefill of what
  arrives during it (forecast rate x mean_prompt tokens), at most what a full batch admits (b /
  mean_output requests per step, each mean_prompt tokens); each running sequence holds about
  mean_prompt + mean_output / 2 tokens of context. Since a request's TPOT is the mean of the
  steps it lives through, bounding every step bounds it.
- Chunk budget (this step): the larger of
  * the most prefill tokens a step may add with the d sequences decoding now and still stay within
    max_itl_factor x the TPOT target (prefill deferred protects the running requests' TPOT), and
  * what the TTFT target needs: prompts waiting (first come, first served) must each be prefilled
    by their deadline, arrival + ttft_deadline_share x the TTFT target; with steps at the TPOT
    target's pace that is max over queued requests k of (tokens up to and including k) / (steps
    left before k's deadline). Requests already past their deadline are lost to the target and do
    not push the budget (their tokens still count for those behind them).
  At least min_chunk_tokens (prefill always moves); at most what keeps a step within half the
  TTFT target (a request arriving just behind it still has half its budget), which is also the
  budget when nobody decodes (no TPOT to protect).
- Capacity and desired replicas: one replica at its cap serves b / (mean_output * step) requests
  per second within the TPOT target; the forecast rate over target_utilization times that, rounded
  up, is how many replicas the role wants. A prefill replica's capacity is its chunk rate over the
  mean prompt.

Before the step model has seen enough steps the configured fixed limits apply; when no cap meets
the TPOT target with the prefill in its steps, the cap is the decode-only one (the prefill is the
chunk budget's to defer). Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ferry.slo.admission import (
    QueuedPrompt,
    RunningDecode,
    num_losing_tpot,
    on_time_order,
    seats_to_add,
    tpot_slack_ms,
)
from ferry.slo.step_model import StepRecord, StepTimeModel


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
    then the largest whose decode-only step meets it (min_num_seqs if none) and capacity_rps is 0."""


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


class SloController:
    def __init__(self, model: StepTimeModel, targets: SloTargets, limits: ControllerLimits | None = None) -> None:
        self.model, self.targets = model, targets
        self.limits = limits or ControllerLimits()

    def _step_ms(self, num_seqs: int, num_prefill_tokens: int, num_context_tokens: float) -> float:
        record = StepRecord(num_seqs, num_prefill_tokens, max(0, round(num_context_tokens)))
        return self.model.predict_ms(record, self.targets.quantile)

    # ---- decode ----------------------------------------------------------------------------------
    def decode_plan(self, mix: TokenMix, prefill_in_steps: bool = True, rate_rps: float | None = None) -> Plan:
        """The decode batch cap for this mix; prefill_in_steps: the same engine also prefills (role
        'both'), so each step carries prefill tokens: at cap b, what b / mean_output admissions a
        step bring (the batch full), but never more than what arrives in a step at rate_rps (None:
        the batch is always full). Below saturation the arrivals, not the cap, set the prefill in
        a step: planning with b x prompt/output tokens there made a document-heavy light load
        (700-token prompts, 36-token answers) look infeasible at any cap and held the cap at its
        minimum. When even min_num_seqs misses the target, the cap is the decode-only one: the
        prefill that breaks the target is not the cap's to bound (a smaller cap removes none of
        what arrives), the chunk budget defers it (admit)."""
        if not self.model.is_ready:
            return Plan(self.limits.fixed_num_seqs, self.limits.fixed_chunk_tokens, 0.0, 0.0, False)
        share = mix.mean_prompt_tokens / max(mix.mean_output_tokens, 1.0) if prefill_in_steps else 0.0
        prompt_tokens_per_ms = math.inf if rate_rps is None else rate_rps * mix.mean_prompt_tokens / 1000.0

        def prefill(b: int) -> int:
            return math.ceil(self._steady_prefill(b, b * share, prompt_tokens_per_ms, mix.mean_context_tokens))

        def step(b: int, with_prefill: bool = True) -> float:
            return self._step_ms(b, prefill(b) if with_prefill else 0, b * mix.mean_context_tokens)

        lim, tpot = self.limits, self.targets.tpot_ms
        if step(lim.min_num_seqs) > tpot:
            cap = _largest(lim.min_num_seqs, lim.max_num_seqs, lambda b: step(b, False) <= tpot)
            return Plan(cap, prefill(cap), step(cap), 0.0, True, is_feasible=False)
        cap = _largest(lim.min_num_seqs, lim.max_num_seqs, lambda b: step(b) <= tpot)
        step_ms = step(cap)
        capacity_rps = cap / max(mix.mean_output_tokens, 1.0) / (step_ms / 1000.0)
        return Plan(cap, prefill(cap), step_ms, capacity_rps, True)

    def _steady_prefill(self, num_seqs: int, full: float, tokens_per_ms: float, context_per_seq: float) -> float:
        """Prefill tokens per step with num_seqs decoding: what arrives during the step (its
        duration depends on that prefill: the least fixed point, from no prefill up), at most
        `full` (the batch full: what b / mean_output admissions a step bring)."""
        tokens = 0.0
        for _ in range(32):  # monotone from below; converges fast unless prefill saturates
            step = self._step_ms(num_seqs, math.ceil(tokens), num_seqs * context_per_seq)
            nxt = min(full, tokens_per_ms * step)
            if nxt - tokens < 0.5:
                return nxt
            tokens = nxt
        return full

    def chunk_budget(
        self,
        num_decodes: int,
        num_context_tokens: int,
        backlog: Sequence[tuple[float, int]] = (),
        now_s: float = 0.0,
    ) -> int:
        """Prefill tokens the next step may add with num_decodes sequences decoding over
        num_context_tokens of context; backlog: (arrival_s, tokens to prefill) of the prompts not
        prefilled yet, first come first, on the clock of now_s."""
        lim = self.limits
        if not self.model.is_ready:
            return lim.fixed_chunk_tokens
        num_seqs = num_decodes + 1

        def fits(tokens: int, bound: float) -> bool:
            return self._step_ms(num_seqs, tokens, num_context_tokens) <= bound

        ceiling = self._ceiling(num_decodes, num_context_tokens)
        if not num_decodes:
            return ceiling
        bound = self.targets.tpot_ms * lim.max_itl_factor
        deferred = _largest(lim.min_chunk_tokens, lim.max_chunk_tokens, lambda n: fits(n, bound))
        return min(max(deferred, self.ttft_chunk(backlog, now_s)), max(ceiling, deferred))

    def ttft_chunk(self, backlog: Sequence[tuple[float, int]], now_s: float) -> int:
        """Prefill tokens per step that get every queued prompt done by its deadline (module doc)."""
        deadline_s = self.targets.ttft_ms * self.limits.ttft_deadline_share / 1000.0
        pace_s = self.targets.tpot_ms / 1000.0
        needed = total = 0
        for arrival_s, num_tokens in backlog:
            total += num_tokens
            steps_left = (arrival_s + deadline_s - now_s) / pace_s - 1  # its first token ends one more step
            if steps_left > 0:
                needed = max(needed, math.ceil(total / steps_left))
        return needed

    def admit(
        self,
        queue: Sequence[QueuedPrompt],
        decodes: Sequence[RunningDecode],
        num_context_tokens: int,
        now_s: float,
        head: Sequence[QueuedPrompt] = (),
        cap: int | None = None,
    ) -> Admission:
        """SLO-aware admission for the next step (ferry.slo.admission): the waiting prompts that
        can still meet the TTFT target first, the late ones behind them; the chunk budget: the
        prefill the tightest live decode's TPOT slack allows, raised to what the on-time prompts
        need to meet their deadlines, within [min_chunk_tokens, the TTFT ceiling]; and with the
        planned `cap`, the cap raised for on-time prompts it would make late (_seats).
        queue: waiting prompts; decodes: the running decodes over num_context_tokens of context;
        head: prompts already admitted and mid-prefill (they go first, whatever this decides)."""
        lim, num_decodes = self.limits, len(decodes)
        if not self.model.is_ready:
            return Admission(list(queue), 0, lim.fixed_chunk_tokens, cap)
        ceiling = self._ceiling(num_decodes, num_context_tokens)
        decode_ms = self._step_ms(num_decodes, 0, num_context_tokens) if num_decodes else 0.0
        per_token_ms = max(self._step_ms(num_decodes + 1, ceiling, num_context_tokens) - decode_ms, 0.0) / ceiling
        deadline_s = self.targets.ttft_ms * lim.on_time_share / 1000.0
        head_ms = sum(p.num_tokens for p in head) * per_token_ms
        on_time, late = on_time_order(queue, now_s, deadline_s, lambda n: n * per_token_ms + decode_ms, head_ms)
        slack = tpot_slack_ms(decodes, now_s, self.targets.tpot_ms, decode_ms)
        if slack is None:
            allowed = ceiling
        else:
            bound = decode_ms + lim.slack_share * slack
            allowed = _largest(
                lim.min_chunk_tokens,
                ceiling,
                lambda n: self._step_ms(num_decodes + 1, n, num_context_tokens) <= bound,
            )
        need = self.ttft_chunk([(p.arrival_s, p.num_tokens) for p in (*head, *on_time)], now_s)
        chunk = min(max(allowed, need, lim.min_chunk_tokens), ceiling)
        if cap is not None:
            in_engine = num_decodes + len(head)
            held = on_time[max(cap - in_engine, 0) :]
            prefill_ms = lambda n: head_ms + n * per_token_ms  # noqa: E731
            seats = self._seats(held, decodes, num_context_tokens, now_s, deadline_s, prefill_ms, decode_ms)
            cap = max(cap, in_engine) + seats if seats else cap
        return Admission([*on_time, *late], len(late), chunk, cap)

    def _seats(
        self,
        held: Sequence[QueuedPrompt],
        decodes: Sequence[RunningDecode],
        num_context_tokens: int,
        now_s: float,
        deadline_s: float,
        prefill_ms: Callable[[int], float],
        decode_ms: float,
    ) -> int:
        """Seats beyond the cap for the on-time prompts it holds back (admission.seats_to_add): a
        seat frees when the running decode with the fewest tokens left ends (never, as far as
        the prompts held now can tell, when none decodes); k more sequences cost every step the
        difference between the decode step with and without them."""
        if not held:
            return 0
        num_decodes, tpot = len(decodes), self.targets.tpot_ms
        wait_ms = min(d.num_remaining for d in decodes) * decode_ms if decodes else math.inf

        def decode_with(k: int) -> float:
            context = num_context_tokens + sum(p.num_tokens for p in held[:k])
            return self._step_ms(num_decodes + k, 0, context)

        def num_broken(k: int) -> int:
            return num_losing_tpot(decodes, now_s, tpot, decode_ms, decode_with(k) - decode_ms)

        return seats_to_add(held, now_s, deadline_s, wait_ms, prefill_ms, num_broken, lambda k: decode_with(k) <= tpot)

    def _ceiling(self, num_decodes: int, num_context_tokens: int) -> int:
        """The most prefill tokens a step may carry: it stays within half the TTFT target."""
        lim, bound = self.limits, self.targets.ttft_ms / 2
        return _largest(
            lim.min_chunk_tokens,
            lim.max_chunk_tokens,
            lambda n: self._step_ms(num_decodes + 1, n, num_context_tokens) <= bound,
        )

    # ---- prefill ---------------------------------------------------------------------------------
    def prefill_plan(self, mix: TokenMix) -> Plan:
        """A prefill-only worker: its chunk budget and how many requests/s it prefills within the
        TTFT target (its sequence cap stays the fixed one: prefill holds KV only briefly)."""
        chunk = self.chunk_budget(0, 0)
        if not self.model.is_ready:
            return Plan(self.limits.fixed_num_seqs, chunk, 0.0, 0.0, False)
        step_ms = self._step_ms(1, chunk, 0)
        tokens_per_s = chunk / (step_ms / 1000.0) if step_ms > 0 else 0.0
        return Plan(self.limits.fixed_num_seqs, chunk, step_ms, tokens_per_s / max(mix.mean_prompt_tokens, 1.0), True)

    # ---- replicas --------------------------------------------------------------------------------
    def desired_replicas(self, forecast_rps: float, plan: Plan, current: int) -> int:
        """Replicas of this role the forecast needs within the targets; `current` until the model
        can say (never 0: a role with no replicas serves nobody)."""
        if not plan.is_model_ready or plan.capacity_rps <= 0:
            return max(current, 1)
        return max(1, math.ceil(forecast_rps / (plan.capacity_rps * self.limits.target_utilization)))


def _largest(lo: int, hi: int, fits) -> int:
    """The largest n in [lo, hi] with fits(n), fits being monotone (true, then false); lo if none."""
    if fits(hi):
        return hi
    if not fits(lo):
        return lo
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

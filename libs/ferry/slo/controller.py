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

Before the step model has seen enough steps the configured fixed limits apply. Overloaded (the
forecast rate above what the cap in target serves), the cap stays the one in target and the rest
queue (decode_plan); when no cap meets the TPOT target with the prefill in its steps, the cap is
min_num_seqs (the prefill is the chunk budget's to defer). Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ferry.slo.admission import (
    QueuedPrompt,
    RunningDecode,
    num_losing_tpot,
    on_time_order,
    seats_to_add,
    tpot_slack_ms,
)
from ferry.slo.step_model import StepRecord, StepTimeModel
from ferry.slo.targets import Admission, ControllerLimits, Plan, SloTargets, TokenMix


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
        step bring (the batch full: the least prefill that keeps b running), but never more than
        what arrives in a step at rate_rps (None: the batch is always full, i.e. overloaded).
        Below saturation the arrivals, not the cap, set the prefill in a step: planning with
        b x prompt/output tokens there made a document-heavy light load look infeasible at any cap.

        held: the largest cap whose step holds the TPOT target; capacity_rps: what it serves.
        - Not overloaded (rate_rps <= capacity_rps): the cap is never below the sequences the
          arrivals keep running (Little: arrival_headroom x rate x mean_output x step), up to the
          decode-only cap, so that bursts are not queued past their TTFT target.
        - Overloaded (rate_rps > capacity_rps, or None): the cap is `held`. Every request admitted
          beyond it makes every running request's steps longer; past `held` all of them miss
          TPOT. Goodput counts requests meeting both targets, and b / (mean_output x step(b)) grows
          with b while step(b) holds the target, so `held` serves the most on time; the rest
          queue (admission puts the ones that can still meet TTFT first).
        - Infeasible (not even min_num_seqs holds the target with the prefill that keeps it
          full): min_num_seqs, the nearest to a step in target (is_feasible False, capacity 0);
          the chunk budget defers prefill within the running requests' TPOT slack. The decode-only
          cap it used to take let the batch grow to 130-250 under overload and broke every
          running request's TPOT (Mooncake replay at load 3.5: TPOT p90 75 ms against 50)."""
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
            low = lim.min_num_seqs
            return Plan(low, prefill(low), step(low), 0.0, True, is_feasible=False, is_overloaded=True)
        held = _largest(lim.min_num_seqs, lim.max_num_seqs, lambda b: step(b) <= tpot)
        step_ms = step(held)
        capacity_rps = held / max(mix.mean_output_tokens, 1.0) / (step_ms / 1000.0)
        if rate_rps is None or rate_rps > capacity_rps:
            return Plan(held, prefill(held), step_ms, capacity_rps, True, is_overloaded=True)
        running = lim.arrival_headroom * rate_rps * mix.mean_output_tokens * step_ms / 1000.0
        if math.ceil(running) <= held:
            return Plan(held, prefill(held), step_ms, capacity_rps, True)
        decode_only = _largest(lim.min_num_seqs, lim.max_num_seqs, lambda b: step(b, False) <= tpot)
        cap = max(held, min(math.ceil(running), decode_only))  # a cap below what arrives only queues it
        return Plan(cap, prefill(cap), step(cap), capacity_rps, True)

    def _steady_prefill(self, num_seqs: int, full: float, tokens_per_ms: float, context_per_seq: float) -> float:
        """Prefill tokens per step with num_seqs decoding: what arrives during the step, whose
        duration grows with that prefill (the model is linear: step = base + slope x p, so
        p = rate x step solves to p = rate x base / (1 - rate x slope)), at most `full` (the batch
        full: what b / mean_output admissions a step bring; also when prefill outruns the step)."""
        if math.isinf(tokens_per_ms):
            return full
        context = num_seqs * context_per_seq
        base = self._step_ms(num_seqs, 0, context)
        slope = (self._step_ms(num_seqs, 100, context) - base) / 100.0
        if tokens_per_ms * slope >= 1.0:
            return full
        return min(full, tokens_per_ms * base / (1.0 - tokens_per_ms * slope))

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

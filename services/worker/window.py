"""The admission window: hold the next engine step a moment while a burst's prompts are still being
pulled, so that they are prefilled together instead of the first one alone.

A burst sent over HTTP reaches a worker one message after another (gateway, balancer, JetStream, a
pull each), and the engine loop starts a step as soon as anything is in the engine: the first step
of a 48-request burst ran 1 prompt, the second 2, then full ones (issue #22), where the in-process
engine, given everything at once, runs only full steps. So while the step to come would not fill
its token budget, it waits for the prompts that are known to be on their way: pulled and not yet
queued on the engine thread, still queued in JetStream for this worker (each pulled message carries
JetStream's count of those behind it), or still queued at the balancer (each routed message carries
the submits the balancer held behind it, `PrefillWork.num_routing_behind`), and that this worker
will pull (room left). It waits at most `window_s`; a lone request (nothing behind it) never waits,
so at low load the window costs nothing.

An idle engine's first step (nothing running: the start of a burst) waits longer, up to `burst_s`,
and past a full budget: the first message of a burst is pulled while the balancer is still routing
the rest (JetStream holds none of them yet), and that step used to run it alone, 155-170 ms of
SmolLM2 on the Xeon box (86-895 ms on the AMD one) that every other prompt of the burst waited
for; and a first step that starts once its budget is full picks the shortest prompts
(FERRY_PREFILL_ORDER) among the ones that happened to arrive first, not among the burst. Once the
hold has seen a prompt arrive, it also waits while the burst keeps arriving (the last one less than
`window_s` ago): the client, the gateway and the balancer pass a burst on in spurts, and the
balancer's queue ran dry after 13 of a 48-request burst on the Xeon box (gaps between pulls: up to
13.5 ms; the whole burst pulled within 10-81 ms of its first request).
Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class AdmissionWindow:
    window_s: float
    """Most time one step waits for arrivals; 0 = never."""
    burst_s: float = 0.0
    """Most time an idle engine's first step waits for arrivals (at least window_s)."""
    num_pending: int = 0
    """Messages queued for this worker behind the last one pulled (0 after a pull that found nothing)."""
    num_routing: int = 0
    """Submits the balancer held behind the last message pulled (0 after a pull that found nothing)."""
    num_arrived: int = 0
    """New requests pulled since start: a held step tells arrivals during its hold by it."""
    admitting: set[str] = field(default_factory=set)
    """Request ids pulled whose engine addition is not queued on the engine thread yet."""

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError(f"window_s={self.window_s!r} must be >= 0")
        if self.burst_s < 0:
            raise ValueError(f"burst_s={self.burst_s!r} must be >= 0")

    def pulled(self, request_ids: list[str], num_pending: int, num_routing: int = 0) -> None:
        """A fetch returned these new requests (maybe none) with `num_pending` still queued behind them
        in JetStream and `num_routing` at the balancer."""
        self.admitting.update(request_ids)
        self.num_arrived += len(request_ids)
        self.num_pending = num_pending
        self.num_routing = num_routing

    def queued(self, request_id: str) -> None:
        """Its addition is on the engine thread (a step queued from now on takes it), or it will not be added."""
        self.admitting.discard(request_id)

    def limit_s(self, is_idle: bool) -> float:
        """Most time the next step waits: longer on an idle engine (a burst's first step)."""
        return max(self.window_s, self.burst_s) if is_idle else self.window_s

    def should_hold(
        self,
        held_s: float,
        can_pull: bool,
        num_queued_tokens: int,
        budget_tokens: int,
        is_idle: bool = False,
        quiet_s: float = math.inf,
    ) -> bool:
        """Whether the next step should wait longer, having waited `held_s`: prompts are on their way
        (`can_pull`: the worker has room to pull what is queued for it) and either the step would not fill
        its budget or the engine is idle (`is_idle`: the first step of a burst, which shortest-first
        should pick among the whole burst); on an idle engine also while a burst keeps arriving (`quiet_s`:
        since the last request pulled during this hold, inf if none)."""
        if held_s >= self.limit_s(is_idle):
            return False
        if is_idle and quiet_s < self.window_s:
            return True
        if num_queued_tokens >= budget_tokens and not is_idle:
            return False
        return bool(self.admitting) or (can_pull and (self.num_pending > 0 or self.num_routing > 0))

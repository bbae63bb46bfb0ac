"""The admission window: hold the next engine step a moment while a burst's prompts are still being
pulled, so that they are prefilled together instead of the first one alone.

A burst sent over HTTP reaches a worker one message after another (gateway, balancer, JetStream, a
pull each), and the engine loop starts a step as soon as anything is in the engine: the first step
of a 48-request burst ran 1 prompt, the second 2, then full ones (issue #22), where the in-process
engine, given everything at once, runs only full steps. So while the step to come would not fill
its token budget, it waits for the prompts that are known to be on their way: pulled and not yet
queued on the engine thread, or still queued in JetStream for this worker (each pulled message
carries JetStream's count of those behind it), and that this worker will pull (room left). It
waits at most `window_s`; a lone request (nothing behind it) never waits, so at low load the window
costs nothing. Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AdmissionWindow:
    window_s: float
    """Most time one step waits for arrivals; 0 = never."""
    num_pending: int = 0
    """Messages queued for this worker behind the last one pulled (0 after a pull that found nothing)."""
    admitting: set[str] = field(default_factory=set)
    """Request ids pulled whose engine addition is not queued on the engine thread yet."""

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError(f"window_s={self.window_s!r} must be >= 0")

    def pulled(self, request_ids: list[str], num_pending: int) -> None:
        """A fetch returned these new requests (maybe none) with `num_pending` still queued behind them."""
        self.admitting.update(request_ids)
        self.num_pending = num_pending

    def queued(self, request_id: str) -> None:
        """Its addition is on the engine thread (a step queued from now on takes it), or it will not be added."""
        self.admitting.discard(request_id)

    def should_hold(self, held_s: float, can_pull: bool, num_queued_tokens: int, budget_tokens: int) -> bool:
        """Whether the next step should wait longer, having waited `held_s`: it would not fill its budget
        and prompts are on their way (`can_pull`: the worker has room to pull what is queued for it)."""
        if held_s >= self.window_s or num_queued_tokens >= budget_tokens:
            return False
        return bool(self.admitting) or (can_pull and self.num_pending > 0)

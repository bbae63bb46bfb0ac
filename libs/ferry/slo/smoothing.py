"""CapSmoother: hysteresis on the planned batch cap, so that it does not flap step to step.

The controller plans a cap before every step from a forecast rate and a token mix that move with
every arrival and completion; near the edge between loaded and overloaded (decode_plan) the plan
can swing between two values step after step. A cap that swings admits a burst of prefill when
it rises and holds the queue when it falls, neither of which the step model planned for.

Rule: a plan within `band` (a share of the cap in force, at least 1 sequence) leaves the cap as
it is; a plan outside it moves the cap only after `hold_steps` consecutive plans outside it on the
same side, and then to the nearest of those plans (the least change they all ask for: one spike
at the end of the run does not set the cap). A plan on the other side, or inside the band, starts
the count again. Pure Python.
"""

from __future__ import annotations


class CapSmoother:
    def __init__(self, band: float = 0.15, hold_steps: int = 4) -> None:
        if not 0 <= band < 1:
            raise ValueError(f"CapSmoother.band={band}: must be in [0, 1)")
        if hold_steps < 1:
            raise ValueError(f"CapSmoother.hold_steps={hold_steps}: must be >= 1")
        self.band, self.hold_steps = band, hold_steps
        self.cap: int | None = None
        """The cap in force (None before the first plan)."""
        self._pending: list[int] = []
        """The consecutive plans outside the band, all on one side of the cap."""

    def update(self, planned: int) -> int:
        """The cap in force after this step's plan."""
        if planned < 1:
            raise ValueError(f"CapSmoother.update: planned={planned} must be >= 1")
        cap = self.cap
        if cap is None:
            self.cap = planned
            return planned
        if abs(planned - cap) <= max(1.0, self.band * cap):
            self._pending.clear()
            return cap
        if self._pending and (self._pending[0] > cap) != (planned > cap):
            self._pending.clear()
        self._pending.append(planned)
        if len(self._pending) >= self.hold_steps:
            cap = self.cap = min(self._pending) if planned > cap else max(self._pending)
            self._pending.clear()
        return cap

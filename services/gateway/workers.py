"""Which workers are alive, from their periodic load reports on `ferry.load.>`. Pure: no NATS.

A worker counts as alive until it misses `MISSED_REPORTS` reports in a row; a draining worker
does not count, because nothing new will be routed to it.
"""

from __future__ import annotations

from ferry.protocol import ROLES, LoadReport

MISSED_REPORTS = 3


class LiveWorkers:
    def __init__(self) -> None:
        self._reports: dict[tuple[str, str], tuple[LoadReport, float]] = {}
        self.last_heard = 0.0
        """When any report last arrived."""
        self.resumed_at = 0.0
        """When reports came back after a stretch where none arrived (our own bus outage):
        silence before then says nothing about a worker."""

    def observe(self, report: LoadReport, now: float) -> None:
        if self.last_heard and now - self.last_heard > MISSED_REPORTS * report.interval_s:
            self.resumed_at = now
        self.last_heard = now
        self._reports[(report.role, report.worker_id)] = (report, now)

    def alive(self, role: str, now: float) -> list[str]:
        """Ids of the `role` workers heard from recently and not draining (a prefill worker that
        decodes what it prefilled, `LoadReport.decodes`, counts as a decode worker too)."""
        return sorted(
            worker_id
            for (r, worker_id), (report, seen) in self._reports.items()
            if (r == role or (role == "decode" and report.decodes))
            and not report.draining
            and now - seen <= MISSED_REPORTS * report.interval_s
        )

    def weights_dtypes(self, now: float) -> list[str]:
        """The weights dtypes live workers report (one, unless workers of different weights serve)."""
        return sorted(
            {
                report.weights_dtype
                for report, seen in self._reports.values()
                if report.weights_dtype and now - seen <= MISSED_REPORTS * report.interval_s
            }
        )

    def silent_for(self, worker_id: str, now: float) -> float | None:
        """How many report intervals past its deadline `worker_id` is (> 0: lost; a draining worker
        that still reports is not); None if never heard of (or long forgotten). While no worker at
        all is heard, the silence is ours (bus down), not the worker's: it counts from when reports resume."""
        for (_, wid), (report, seen) in self._reports.items():
            if wid == worker_id:
                if now - self.last_heard > report.interval_s * MISSED_REPORTS:
                    return None  # we hear nobody: cannot judge
                return (now - max(seen, self.resumed_at)) / report.interval_s - MISSED_REPORTS
        return None

    def interval_of(self, worker_id: str) -> float | None:
        return next((report.interval_s for (_, wid), (report, _) in self._reports.items() if wid == worker_id), None)

    def missing_roles(self, now: float) -> list[str]:
        return [role for role in ROLES if not self.alive(role, now)]

    def forget_stale(self, now: float) -> None:
        """Drop workers gone for long, so that a churning deployment does not grow this map."""
        for key, (report, seen) in list(self._reports.items()):
            if now - seen > 10 * MISSED_REPORTS * report.interval_s:
                del self._reports[key]

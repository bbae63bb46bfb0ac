"""A balancer's live view of the workers of one role, built from their periodic load reports.

Pure: no NATS, no clock of its own (callers pass `now`), so it is tested without servers.
Both balancers route on it; their policies read `WorkerState`s.

A report is a snapshot taken every `interval_s`; between two reports the balancer keeps routing,
so it adds what it routed since the last report on top (`note_routed`) — otherwise every request
in a burst would see the same snapshot and land on the same worker. A worker whose last report is
older than `silent_after_intervals` of its own interval is *silent*: it leaves routing, and
`expire` names it once so the service can re-route its queued work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.protocol import LoadReport


@dataclass(slots=True)
class WorkerState:
    """One worker as a balancer sees it: its last report plus what was routed to it since."""

    report: LoadReport
    received_at: float
    """Balancer-local time the report arrived (clocks of other machines are never compared)."""
    routed_seqs: int = 0
    """Sequences routed here since `report`."""
    routed_tokens: int = 0
    """Prefill tokens routed here since `report`."""
    routed_attention: float = 0.0
    """Attention work (token pairs) routed here since `report`."""
    routed_blocks: int = 0
    """KV blocks that sequences routed here since `report` will take."""

    @property
    def worker_id(self) -> str:
        return self.report.worker_id

    @property
    def num_seqs(self) -> int:
        """Running + waiting + queued in JetStream + routed since the report: what counts against
        the batch cap."""
        return self.report.num_running + self.report.num_waiting + self.report.num_backlog + self.routed_seqs

    @property
    def queued_prefill_tokens(self) -> int:
        return self.report.num_queued_prefill_tokens + self.routed_tokens

    @property
    def kv_blocks_used(self) -> int:
        return self.report.kv_blocks_used + self.routed_blocks

    @property
    def kv_blocks_free(self) -> int:
        return max(0, self.report.kv_blocks_total - self.kv_blocks_used)


@dataclass(slots=True)
class WorkerView:
    """Workers of one role by id; silent and draining workers are not routable."""

    role: str
    silent_after_intervals: float = 3.0
    """A worker is silent after this many of its report intervals without a report."""
    workers: dict[str, WorkerState] = field(default_factory=dict)
    silent_ids: set[str] = field(default_factory=set)
    """Workers that went silent and have not reported since."""

    def __post_init__(self) -> None:
        if self.silent_after_intervals <= 1:
            raise ValueError(f"silent_after_intervals={self.silent_after_intervals!r} must be > 1")

    def update(self, report: LoadReport, now: float) -> None:
        """Take a new report; a report from a silent worker brings it back."""
        if report.role != self.role:
            raise ValueError(f"role={report.role!r}: this view holds {self.role!r} workers")
        self.workers[report.worker_id] = WorkerState(report=report, received_at=now)
        self.silent_ids.discard(report.worker_id)

    def note_routed(self, worker_id: str, *, tokens: int = 0, attention: float = 0.0, blocks: int = 0) -> None:
        """Count one sequence routed to `worker_id` until its next report shows it."""
        state = self.workers.get(worker_id)
        if state is None:
            return  # it went silent while we decided; its work gets re-routed
        state.routed_seqs += 1
        state.routed_tokens += tokens
        state.routed_attention += attention
        state.routed_blocks += blocks

    def expire(self, now: float) -> list[str]:
        """Drop workers that fell silent; each id is returned once, when it leaves."""
        gone = [w for w, s in self.workers.items() if self._is_silent(s, now)]
        for worker_id in gone:
            del self.workers[worker_id]
            self.silent_ids.add(worker_id)
        return gone

    def routable(self, now: float, model: str = "") -> list[WorkerState]:
        """Workers that may take new work, sorted by id so that ties break the same way.

        With `model`, workers serving exactly that model are preferred; when none does (a
        one-model deployment whose clients name it differently) every worker qualifies."""
        live = [s for s in self.workers.values() if not s.report.draining and not self._is_silent(s, now)]
        matching = [s for s in live if s.report.model == model] if model else []
        return sorted(matching or live, key=lambda s: s.worker_id)

    def _is_silent(self, state: WorkerState, now: float) -> bool:
        return now - state.received_at > self.silent_after_intervals * state.report.interval_s

"""A worker group's ranks as a balancer sees them (`LoadReport.ranks`). Pure: no NATS, no torch.

A group (`FERRY_EP_SIZE` > 1) holds one model across its ranks, but attention is data-parallel:
each rank has its own batch, KV pool and prefill queue, and a new sequence lands on one rank (the
group deals it to its least loaded). So the seed balances per rank: decode by each rank's KV usage
and running requests, prefill by each rank's core-attention work and tokens. What was routed to
the group since its report is not on any rank yet: it is spread evenly over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.balancing.view import WorkerState


@dataclass(slots=True)
class RankView:
    num_seqs: float
    """Running + waiting, plus a share of the group's backlog and of what was routed since its report."""
    max_running: int
    kv_blocks_used: float
    kv_blocks_total: int
    queued_tokens: float
    """Prefill tokens queued on the rank (a share of the routed ones included)."""
    queued_attention: float
    """Query-key pairs of those tokens' causal attention."""

    def fits(self, num_blocks: int) -> bool:
        return self.num_seqs < self.max_running and self.kv_blocks_used + num_blocks <= self.kv_blocks_total


def rank_views(state: WorkerState) -> list[RankView]:
    """One view per rank of a group, [] for a single-process worker."""
    ranks = state.report.ranks
    if not ranks:
        return []
    n = len(ranks)
    seqs = (state.report.num_backlog + state.routed_seqs) / n
    return [
        RankView(
            num_seqs=r.num_running + r.num_waiting + seqs,
            max_running=r.max_running,
            kv_blocks_used=r.kv_blocks_used + state.routed_blocks / n,
            kv_blocks_total=r.kv_blocks_total,
            queued_tokens=r.num_queued_prefill_tokens + state.routed_tokens / n,
            queued_attention=r.queued_prefill_attention + state.routed_attention / n,
        )
        for r in ranks
    ]

"""Which rank of a worker group takes a new sequence. Pure: no torch, no processes.

Attention is data-parallel: each rank holds its own sequences and KV pool, so a group admits a
sequence onto one rank. The seed balances decode by KV usage and running requests; the group does
the same among its ranks: the rank with the lowest batch fill + KV usage after taking it wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class RankState:
    """One rank as its group's rank 0 sees it: its last stats, plus what was dealt to it since."""

    num_seqs: int
    """Sequences it holds (running + waiting), dealt ones included."""
    max_seqs: int
    kv_blocks_used: int
    kv_blocks_total: int

    def score(self, num_blocks: int) -> float:
        """Batch fill + KV usage once it takes a sequence of num_blocks blocks."""
        fill = (self.num_seqs + 1) / max(self.max_seqs, 1)
        return fill + (self.kv_blocks_used + num_blocks) / max(self.kv_blocks_total, 1)

    def fits(self, num_blocks: int) -> bool:
        return self.num_seqs < self.max_seqs and self.kv_blocks_used + num_blocks <= self.kv_blocks_total


def ranks_by_preference(ranks: Sequence[RankState], num_blocks: int) -> list[int]:
    """Rank indices, the best place for a sequence of num_blocks blocks first: ranks it fits on by
    score (ties: the lower rank), then the others (their engine may still queue it)."""
    order = sorted(range(len(ranks)), key=lambda r: (not ranks[r].fits(num_blocks), ranks[r].score(num_blocks), r))
    return order

"""Where a prefilled sequence decodes. Pure: no NATS, no torch.

DeepSeek balances decode workers by KV-cache usage and request count. A worker qualifies when it
is under its batch cap (`max_running`, counting sequences routed since its last report) and has
free KV blocks for the sequence's cache plus the next token; among those, the one with the
lowest KV usage + batch fill after taking the sequence, less its session-affinity credit, wins
(`affinity_weight` x the share of the sequence's KV chain the worker already holds from an earlier
turn: a preference that load outweighs, not a pin). A worker group is weighed per rank
(`ferry.balancing.ranks`): it qualifies when one of its ranks does, and scores as its best rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ferry.balancing.ranks import RankView, rank_views
from ferry.balancing.view import WorkerState
from ferry.protocol import HANDOFF_TOO_LONG


@dataclass(slots=True)
class DecodePolicyConfig:
    kv_weight: float = 1.0
    """Weight of KV-cache usage (0..1) in the score."""
    seqs_weight: float = 1.0
    """Weight of batch fill (running / max_running, 0..1) in the score."""
    affinity_weight: float = 0.5
    """Score credit of a worker that holds the whole of the sequence's KV chain (an earlier turn of the
    conversation decoded there), in proportion to the share it holds. The load part of a score runs
    0..kv_weight + seqs_weight (2 by default): 0.5 keeps a conversation on its worker until that worker
    is about a quarter fuller than another, then load wins. 0 = no affinity."""
    retry_after_s: float = 0.5

    def __post_init__(self) -> None:
        if self.affinity_weight < 0:
            raise ValueError(f"affinity_weight={self.affinity_weight!r} must be >= 0")
        if self.kv_weight < 0 or self.seqs_weight < 0 or self.kv_weight + self.seqs_weight == 0:
            raise ValueError(
                f"kv_weight={self.kv_weight!r}, seqs_weight={self.seqs_weight!r}: must be >= 0 and not both 0"
            )
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s={self.retry_after_s!r} must be > 0")


@dataclass(slots=True)
class DecodeChoice:
    worker_id: str | None
    """None when rejected."""
    reason: str = ""
    """'' when routed; 'overloaded' (every worker full now), 'no_workers', or HANDOFF_TOO_LONG and why (no worker's
    whole pool holds the sequence: not worth a retry)."""
    num_blocks: int = 0
    """Blocks the sequence takes on the chosen worker."""
    retry_after_s: float = 0.0


def blocks_needed(num_kv_tokens: int, block_size: int) -> int:
    """Blocks for the cached tokens plus the slot of the next one."""
    return -(-(num_kv_tokens + 1) // block_size)


def decode_score(state: WorkerState, num_blocks: int, config: DecodePolicyConfig) -> float:
    """KV usage and batch fill once the sequence is there; for a worker group, of the rank it would
    land on (the best one it fits: attention is data-parallel, each rank its own KV and batch)."""
    ranks = [r for r in rank_views(state) if r.fits(num_blocks)]
    if ranks:
        return min(
            _score(r.kv_blocks_used, r.kv_blocks_total, r.num_seqs, r.max_running, num_blocks, config) for r in ranks
        )
    report = state.report
    return _score(state.kv_blocks_used, report.kv_blocks_total, state.num_seqs, report.max_running, num_blocks, config)


def _score(kv_used: float, kv_total: int, num_seqs: float, max_running: int, num_blocks: int, config) -> float:
    kv_usage = (kv_used + num_blocks) / max(kv_total, 1)
    fill = (num_seqs + 1) / max(max_running, 1)
    return config.kv_weight * kv_usage + config.seqs_weight * fill


def fits(state: WorkerState, num_blocks: int) -> bool:
    """Under the batch cap and enough free KV blocks: a worker group's, on one of its ranks."""
    ranks: list[RankView] = rank_views(state)
    if ranks:
        return any(r.fits(num_blocks) for r in ranks)
    return state.num_seqs < state.report.max_running and state.kv_blocks_free >= num_blocks


def _pool_blocks(state: WorkerState) -> int:
    """The most blocks one sequence can ever hold on this worker: its pool, or its largest rank's."""
    ranks = rank_views(state)
    return max(r.kv_blocks_total for r in ranks) if ranks else state.report.kv_blocks_total


def affinity_credit(share: float, config: DecodePolicyConfig) -> float:
    """What holding `share` (0..1) of the sequence's chain takes off a worker's score."""
    return config.affinity_weight * min(max(share, 0.0), 1.0)


def choose_decode_worker(
    workers: Sequence[WorkerState],
    num_kv_tokens: int,
    config: DecodePolicyConfig,
    affinity: Mapping[str, float] | None = None,
) -> DecodeChoice:
    """Pick the least loaded worker that can take the sequence now, or say why none can.

    `affinity`: per worker id, the share (0..1) of the sequence's KV chain it holds (session affinity)."""
    affinity = affinity or {}
    if not workers:
        return DecodeChoice(None, "no_workers", retry_after_s=config.retry_after_s)
    best: tuple[float, WorkerState, int] | None = None
    for state in workers:
        num_blocks = blocks_needed(num_kv_tokens, state.report.block_size)
        if not fits(state, num_blocks):
            continue
        score = decode_score(state, num_blocks, config) - affinity_credit(affinity.get(state.worker_id, 0.0), config)
        if best is None or score < best[0]:
            best = (score, state, num_blocks)
    if best is None:

        def needed(state: WorkerState) -> int:
            return blocks_needed(num_kv_tokens, state.report.block_size)

        if all(needed(state) > _pool_blocks(state) for state in workers):  # each by its own block size
            roomiest = max(workers, key=lambda state: _pool_blocks(state) * state.report.block_size)
            pools = (
                f"{num_kv_tokens} tokens need {needed(roomiest)} KV blocks, "
                f"the largest decode worker's pool has {_pool_blocks(roomiest)}"
            )
            return DecodeChoice(None, f"{HANDOFF_TOO_LONG}: {pools}")
        return DecodeChoice(None, "overloaded", retry_after_s=config.retry_after_s)
    return DecodeChoice(best[1].worker_id, num_blocks=best[2])

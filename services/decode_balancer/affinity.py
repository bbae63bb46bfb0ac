"""Session affinity for decode routing: which decode worker holds which blocks of recent
conversations. Pure: no I/O.

Each turn of a chat re-sends the whole conversation, so the KV chain of turn k (prompt + answer) is
the head of turn k+1's. The decode worker that served turn k still has that chain in its pool
(a finished sequence's blocks stay there as prefix cache until evicted), so the next turn is best
decoded there. Fed by the balancer's own routing (the hand-off's full blocks, at once) and by every
turn-end `KvWarm` (the whole chain, answer included, from the worker that served it: every replica
hears it, so replicas agree). Bounded: each worker keeps its most recently noted
`max_blocks_per_worker` hashes, at most `max_workers` workers are kept; a block forgotten here only
loses a preference, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ferry.balancing.chains import num_leading_held


class SessionAffinity:
    def __init__(self, max_blocks_per_worker: int = 65_536, max_workers: int = 256) -> None:
        if max_blocks_per_worker < 1 or max_workers < 1:
            raise ValueError(f"max_blocks_per_worker={max_blocks_per_worker!r}, max_workers={max_workers!r}: >= 1")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_workers = max_workers
        self._held: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()

    def note(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        """`worker_id` holds these blocks now (it was routed the sequence, or served the turn)."""
        held = self._held.get(worker_id)
        if held is None:
            held = self._held[worker_id] = OrderedDict()
            while len(self._held) > self.max_workers:
                self._held.popitem(last=False)
        self._held.move_to_end(worker_id)
        for block_hash in block_hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.max_blocks_per_worker:
            held.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """Its pool is gone (it restarted or left)."""
        self._held.pop(worker_id, None)

    def leading(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the worker holds."""
        return num_leading_held(self._held.get(worker_id), block_hashes)

    def shares(self, worker_ids: Iterable[str], block_hashes: Sequence[bytes]) -> dict[str, float]:
        """Per worker: the share (0..1) of the chain's blocks it holds from the start: the routing input."""
        if not block_hashes:
            return {}
        return {w: n / len(block_hashes) for w in worker_ids if (n := self.leading(w, block_hashes))}

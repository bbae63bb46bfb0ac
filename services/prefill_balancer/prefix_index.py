"""Which prompt-prefix blocks each prefill worker's pool and the shared store hold. Pure: no I/O.

Fed by `KvEvent`s on `ferry.kv.events` (a worker's pool: where=<worker id>; Redis: where='store')
and by the balancer's own routing (a worker that was just sent a prompt will hold its blocks
soon: marking them at once spreads a burst of same-prefix requests instead of piling it on the
one worker that happened to report first). Bounded: each location keeps its most recently
touched `max_blocks_per_location` hashes, and at most `max_locations` locations are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

STORE = "store"


@dataclass(slots=True)
class PrefixIndexConfig:
    max_blocks_per_location: int = 200_000
    """~40 MB of hashes per location at most; older entries are forgotten first (they are the
    likeliest to have been evicted there anyway)."""
    max_locations: int = 256
    """Worker pools (+ the store) tracked; the least recently updated is dropped past this."""
    store_weight: float = 0.5
    """A block in the store counts this much of a block in a worker's own pool: it still has to
    travel from Redis, while a pool hit costs nothing."""

    def __post_init__(self) -> None:
        if self.max_blocks_per_location < 1:
            raise ValueError(f"max_blocks_per_location={self.max_blocks_per_location!r} must be >= 1")
        if self.max_locations < 2:
            raise ValueError(f"max_locations={self.max_locations!r} must be >= 2")
        if not 0 <= self.store_weight <= 1:
            raise ValueError(f"store_weight={self.store_weight!r} must be in [0, 1]")


class PrefixIndex:
    """(namespace, where) -> block hashes held there, in least-recently-touched order."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        self._held: OrderedDict[tuple[str, str], OrderedDict[bytes, None]] = OrderedDict()

    def num_blocks(self, namespace: str, where: str) -> int:
        return len(self._held.get((namespace, where), ()))

    def apply(self, kind: str, namespace: str, where: str, block_hashes: Iterable[bytes] = ()) -> None:
        """One event: kind 'stored', 'removed' or 'cleared'."""
        key = (namespace, where)
        if kind == "cleared":
            self._held.pop(key, None)
        elif kind == "removed":
            held = self._held.get(key)
            for block_hash in block_hashes if held is not None else ():
                held.pop(block_hash, None)
        elif kind == "stored":
            self._store(key, block_hashes)
        else:
            raise ValueError(f"kind={kind!r}: must be 'stored', 'removed' or 'cleared'")

    def forget(self, where: str) -> None:
        """A worker left: its pool is of no use to routing any more."""
        for key in [k for k in self._held if k[1] == where]:
            del self._held[key]

    def leading(self, namespace: str, where: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain are held there."""
        held = self._held.get((namespace, where))
        if not held:
            return 0
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in held:
                return i
        return len(block_hashes)

    def cached_tokens(
        self, namespace_of: Mapping[str, str], block_hashes: Sequence[bytes], block_size: int
    ) -> dict[str, int]:
        """Per worker id: prompt tokens it would not compute, pool blocks at full weight and the
        store's further blocks at `store_weight`."""
        result = {}
        for worker_id, namespace in namespace_of.items():
            local = self.leading(namespace, worker_id, block_hashes)
            stored = self.leading(namespace, STORE, block_hashes)
            blocks = local + self.config.store_weight * max(0, stored - local)
            result[worker_id] = int(blocks * block_size)
        return result

    def _store(self, key: tuple[str, str], block_hashes: Iterable[bytes]) -> None:
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = OrderedDict()
            while len(self._held) > self.config.max_locations:
                self._held.popitem(last=False)
        self._held.move_to_end(key)
        for block_hash in block_hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.config.max_blocks_per_location:
            held.popitem(last=False)

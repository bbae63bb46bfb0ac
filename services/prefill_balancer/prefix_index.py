"""Which prompt-prefix blocks each prefill worker's pool and host tier and the shared store hold.
Pure: no I/O.

Fed by `KvEvent`s on `ferry.kv.events` (a worker's pool: where=<worker id>, tier 'device'; the
blocks it evicted into host memory: tier 'host'; Redis: where='store', tier 'remote')
and by the balancer's own routing (a worker that was just sent a prompt will hold its blocks
soon: marking them at once spreads a burst of same-prefix requests instead of piling it on the
one worker that happened to report first). Bounded: each location keeps its most recently
touched `max_blocks_per_location` hashes, and at most `max_locations` locations are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ferry.balancing.chains import num_leading_held

STORE = "store"


@dataclass(slots=True)
class PrefixIndexConfig:
    max_blocks_per_location: int = 200_000
    """~40 MB of hashes per location at most; older entries are forgotten first (they are the
    likeliest to have been evicted there anyway)."""
    max_locations: int = 256
    """Worker pools (+ the store) tracked; the least recently updated is dropped past this."""
    device_weight: float = 1.0
    """Credit of a block in the worker's own pool: a hit costs nothing."""
    host_weight: float = 0.75
    """... in the worker's host memory: a copy into the pool, no network."""
    remote_weight: float = 0.25
    """... in the store only: it still travels from Redis, and only when the prompt reaches the worker."""

    def __post_init__(self) -> None:
        if self.max_blocks_per_location < 1:
            raise ValueError(f"max_blocks_per_location={self.max_blocks_per_location!r} must be >= 1")
        if self.max_locations < 2:
            raise ValueError(f"max_locations={self.max_locations!r} must be >= 2")
        for name in ("device_weight", "host_weight", "remote_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [0, 1]")

    def weight(self, tier: str) -> float:
        return getattr(self, f"{tier}_weight")


class PrefixIndex:
    """(namespace, where, tier) -> block hashes held there, in least-recently-touched order."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        self._held: OrderedDict[tuple[str, str, str], OrderedDict[bytes, None]] = OrderedDict()

    def num_blocks(self, namespace: str, where: str, tier: str | None = None) -> int:
        return len(self._held.get((namespace, where, tier or _tier_of(where)), ()))

    def apply(
        self, kind: str, namespace: str, where: str, block_hashes: Iterable[bytes] = (), tier: str = "device"
    ) -> None:
        """One event: kind 'stored', 'removed' or 'cleared'; the store's blocks are always 'remote'."""
        key = (namespace, where, _tier_of(where, tier))
        if kind == "cleared":
            self._held.pop(key, None)
        elif kind == "removed":
            held = self._held.get(key)
            if held is not None:
                for block_hash in block_hashes:
                    held.pop(block_hash, None)
        elif kind == "stored":
            self._store(key, block_hashes)
        else:
            raise ValueError(f"kind={kind!r}: must be 'stored', 'removed' or 'cleared'")

    def forget(self, where: str) -> None:
        """A worker left: its pool is of no use to routing any more."""
        for key in [k for k in self._held if k[1] == where]:
            del self._held[key]

    def leading(self, namespace: str, where: str, block_hashes: Sequence[bytes], tier: str | None = None) -> int:
        """How many leading blocks of the chain are held there (in that tier: default device, or remote
        for the store)."""
        return num_leading_held(self._held.get((namespace, where, tier or _tier_of(where))), block_hashes)

    def cached_tokens(
        self, namespace_of: Mapping[str, str], block_hashes: Sequence[bytes], block_size: int
    ) -> dict[str, int]:
        """Per worker id: prompt tokens it would not compute, each leading block credited by the
        fastest tier that holds it for that worker (its pool, its host memory, the store)."""
        result = {}
        for worker_id, namespace in namespace_of.items():
            result[worker_id] = int(sum(self.tier_credits(namespace, worker_id, block_hashes)) * block_size)
        return result

    def tier_credits(self, namespace: str, worker_id: str, block_hashes: Sequence[bytes]) -> list[float]:
        """The credit of each leading block the worker could have without computing it."""
        config = self.config
        candidates = [
            (config.device_weight, self._held.get((namespace, worker_id, "device"))),
            (config.host_weight, self._held.get((namespace, worker_id, "host"))),
            (config.remote_weight, self._held.get((namespace, STORE, "remote"))),
        ]
        places = [(weight, held) for weight, held in candidates if held]
        credits = []
        for block_hash in block_hashes:
            best = max((weight for weight, held in places if block_hash in held), default=None)
            if best is None:
                break
            credits.append(best)
        return credits

    def only_in_store(self, namespace: str, worker_id: str, block_hashes: Sequence[bytes]) -> list[bytes]:
        """The prompt's leading blocks (as far as any tier holds them for this worker) that only the
        store holds: what a prefetch would bring into the worker."""
        local: list[Mapping[bytes, None]] = [
            self._held.get((namespace, worker_id, tier)) or {} for tier in ("device", "host")
        ]
        stored: Mapping[bytes, None] = self._held.get((namespace, STORE, "remote")) or {}
        missing = []
        for block_hash in block_hashes:
            if any(block_hash in held for held in local):
                continue
            if block_hash not in stored:
                break
            missing.append(block_hash)
        return missing

    def not_held(self, namespace: str, worker_id: str, block_hashes: Sequence[bytes]) -> list[bytes]:
        """The chain's blocks neither the worker's pool nor its host tier holds, in chain order: what a
        turn-end warm-up fetches (its sender vouches that the store holds the whole chain)."""
        local: list[Mapping[bytes, None]] = [
            self._held.get((namespace, worker_id, tier)) or {} for tier in ("device", "host")
        ]
        return [h for h in block_hashes if not any(h in held for held in local)]

    def _store(self, key: tuple[str, str, str], block_hashes: Iterable[bytes]) -> None:
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


def _tier_of(where: str, tier: str = "device") -> str:
    return "remote" if where == STORE else tier

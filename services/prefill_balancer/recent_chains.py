"""The chains of the most recent turn-end warm-ups, one per conversation, for re-warming a worker that
restarted. Pure: no I/O.

A worker's host tier dies with it: the turns its warm-ups prepared would be served from the store on
their requests' critical path. The prefill-balancer keeps the last `max_chains` warm-up chains (a
conversation's newer turn replaces its older one: the older chain is a prefix of the newer) and replays
them as warm-ups once the restarted worker reports again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RecentChains:
    def __init__(self, max_chains: int = 256) -> None:
        if max_chains < 1:
            raise ValueError(f"max_chains={max_chains!r} must be >= 1")
        self.max_chains = max_chains
        self._chains: OrderedDict[tuple[str, bytes], tuple[str, list[bytes]]] = OrderedDict()
        """(namespace, last block hash) -> (request id, chain), oldest first."""
        self._partials: dict[tuple[str, bytes], bytes] = {}
        """(namespace, last block hash) -> the name of the turn's partial last block, if it had one."""

    def __len__(self) -> int:
        return len(self._chains)

    def add(self, request_id: str, namespace: str, chain: Sequence[bytes], partial: bytes | None = None) -> None:
        """A warm-up of `chain` (and its partial last block `partial`); an earlier chain that is a prefix
        of it (an older turn of the same conversation) goes: block hashes are chained, so equal hashes
        mean equal prefixes."""
        if not chain:
            return
        for block_hash in chain:
            self._chains.pop((namespace, block_hash), None)
            self._partials.pop((namespace, block_hash), None)
        self._chains[(namespace, chain[-1])] = (request_id, list(chain))
        if partial is not None:
            self._partials[(namespace, chain[-1])] = partial
        while len(self._chains) > self.max_chains:
            key, _ = self._chains.popitem(last=False)
            self._partials.pop(key, None)

    def partial(self, namespace: str, chain: Sequence[bytes]) -> bytes | None:
        """The partial last block added with `chain`, if any."""
        return self._partials.get((namespace, chain[-1])) if chain else None

    def of(self, namespace: str) -> list[tuple[str, list[bytes]]]:
        """(request id, chain) of that namespace, oldest first."""
        return [value for (ns, _), value in self._chains.items() if ns == namespace]

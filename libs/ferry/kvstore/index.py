"""What the store holds, as the kvcache service tracks it: blocks and bytes per namespace.

Pure bookkeeping, no I/O: the service feeds it Redis keyspace notifications (a block was set,
deleted, expired or evicted) and full rescans after an outage, and drains the resulting changes as
batched `stored` / `removed` / `cleared` events for the balancers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

MAX_HASHES_PER_EVENT = 4096
"""~75 KB of msgpack per event: far below the bus message limit, large enough to batch a burst."""


@dataclass(slots=True)
class IndexChange:
    """One event to publish: `kind` in ('stored', 'removed', 'cleared') for one namespace."""

    kind: str
    namespace: str
    block_hashes: list[bytes] = field(default_factory=list)


class BlockIndex:
    """namespace -> {block hash: stored bytes}, plus the changes not yet published."""

    def __init__(self) -> None:
        self._blocks: dict[str, dict[bytes, int]] = defaultdict(dict)
        self._stored: dict[str, list[bytes]] = defaultdict(list)
        self._removed: dict[str, list[bytes]] = defaultdict(list)
        self._cleared: set[str] = set()

    def num_blocks(self, namespace: str | None = None) -> int:
        return sum(len(self._blocks.get(ns, {})) for ns in self._namespaces(namespace))

    def num_bytes(self, namespace: str | None = None) -> int:
        return sum(sum(self._blocks.get(ns, {}).values()) for ns in self._namespaces(namespace))

    def blocks_per_namespace(self) -> dict[str, int]:
        return {ns: len(blocks) for ns, blocks in self._blocks.items() if blocks}

    def contents(self) -> list[IndexChange]:
        """Everything held, as 'stored' changes (a balancer that lost its index asks for this)."""
        changes = []
        for ns, blocks in self._blocks.items():
            hashes = list(blocks)
            for start in range(0, len(hashes), MAX_HASHES_PER_EVENT):
                changes.append(IndexChange("stored", ns, hashes[start : start + MAX_HASHES_PER_EVENT]))
        return changes

    def stored(self, namespace: str, block_hash: bytes, num_bytes: int) -> None:
        """A block was written (or rewritten: then only its size changes, no event)."""
        blocks = self._blocks[namespace]
        if block_hash not in blocks:
            self._stored[namespace].append(block_hash)
        blocks[block_hash] = num_bytes

    def removed(self, namespace: str, block_hash: bytes) -> None:
        """A block was deleted, expired or evicted."""
        if self._blocks.get(namespace, {}).pop(block_hash, None) is not None:
            self._removed[namespace].append(block_hash)

    def resync(self, snapshot: dict[str, dict[bytes, int]]) -> None:
        """Replace everything with a full scan; the differences become events."""
        for ns in list(self._blocks):
            if not snapshot.get(ns):
                if self._blocks[ns]:
                    self._cleared.add(ns)
                self._blocks.pop(ns)
                self._stored.pop(ns, None)
                self._removed.pop(ns, None)
        for ns, blocks in snapshot.items():
            for block_hash in self._blocks.get(ns, {}).keys() - blocks.keys():
                self.removed(ns, block_hash)
            for block_hash, num_bytes in blocks.items():
                self.stored(ns, block_hash, num_bytes)

    def drain_changes(self) -> list[IndexChange]:
        """Changes since the last drain: 'cleared' first, then removals, then additions."""
        changes = [IndexChange("cleared", ns) for ns in sorted(self._cleared)]
        for kind, pending in (("removed", self._removed), ("stored", self._stored)):
            for ns, hashes in pending.items():
                for start in range(0, len(hashes), MAX_HASHES_PER_EVENT):
                    changes.append(IndexChange(kind, ns, hashes[start : start + MAX_HASHES_PER_EVENT]))
        self._cleared.clear()
        self._removed.clear()
        self._stored.clear()
        return changes

    def _namespaces(self, namespace: str | None) -> list[str]:
        return list(self._blocks) if namespace is None else [namespace]

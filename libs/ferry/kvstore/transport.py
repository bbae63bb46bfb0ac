"""The data-plane transport interface, and the in-process memory transport.

`KvStore` speaks only these five batched calls, so a shared-memory or RDMA transport can replace
Redis without touching the store or its callers. Every call takes a whole batch: one round trip per
batch, never one per block. A transport raises `KvStoreUnavailable` when its backend is unreachable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class KvTransport(Protocol):
    async def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store every (key, value); each value becomes visible whole, never in part."""

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values in key order; None where a key is absent."""

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key, in order."""

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the keys that exist."""

    async def close(self) -> None:
        """Release connections; the transport is unusable after."""


async def num_leading_present(transport: KvTransport, keys: Sequence[str]) -> int:
    """How many leading keys of a chain the transport holds (one batched EXISTS)."""
    present = await transport.exists_many(keys) if keys else []
    return next((i for i, ok in enumerate(present) if not ok), len(present))


class MemoryTransport:
    """A dict in this process, shared by every KvStore given the same instance.

    With `max_bytes`, the least recently used values are dropped once the total passes it (the same
    policy the service sets on Redis), so a long-lived `both`-role worker stays bounded.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes!r} must be > 0 or None")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._values)

    async def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for key, value in items:
            self._drop(key)
            self._values[key] = bytes(value)
            self.num_bytes += len(value)
        self._evict()

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out = []
        for key in keys:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            out.append(value)
        return out

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._values for key in keys]

    async def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._drop(key)

    async def close(self) -> None:
        self._values.clear()
        self.num_bytes = 0

    def _drop(self, key: str) -> None:
        value = self._values.pop(key, None)
        if value is not None:
            self.num_bytes -= len(value)

    def _evict(self) -> None:
        while self.max_bytes is not None and self.num_bytes > self.max_bytes and self._values:
            _, value = self._values.popitem(last=False)
            self.num_bytes -= len(value)
            self.num_evictions += 1

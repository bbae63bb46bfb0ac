"""HostBlockCache: the host tier between a worker's device pool and the shared KV store.

A block the block manager evicts from the device pool (to reuse its slot) is copied here instead
of being lost, and a later admission that would miss it in the pool loads it back from host
memory instead of fetching it from Redis or recomputing it. Prefetched blocks (ferry.kv prefetch)
land here too: they never take a device slot that running work may need. Bounded: at most
`capacity_blocks` blocks, the least recently used dropped first. On a GPU the blocks sit in
pinned memory, so loading them back is a DMA, not a pageable copy.

Like the block manager it reports its net changes (`drain_events`) for the balancers' index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class HostBlockCache:
    """block hash -> one block's KV, [*block_shape] on the host, in least-recently-used order."""

    def __init__(self, capacity_blocks: int, pin_memory: bool = False) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks={capacity_blocks!r} must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.pin_memory = pin_memory
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._pending: dict[bytes, bool] = {}
        """Net changes since the last drain: hash -> True stored / False removed."""
        self._announced: set[bytes] = set()
        self.num_puts = 0
        self.num_hits = 0
        """Blocks loaded back into the device pool from here, since start."""
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def hashes(self) -> list[bytes]:
        return list(self._blocks)

    def put(self, block_hash: bytes, data: torch.Tensor, owned: bool = False) -> None:
        """Keep one block ([*block_shape], any device: copied to the host) as the most recent.
        owned: data is a host tensor nobody else writes (a KvCopier copy, maybe still landing): kept
        as it is, not copied."""
        if self.capacity_blocks == 0:
            return
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        host = data if owned else data.detach().to("cpu", copy=True)
        if self.pin_memory and not host.is_pinned():
            host = host.pin_memory()
        self._blocks[block_hash] = host
        self._note(block_hash, True)
        self.num_puts += 1
        while len(self._blocks) > self.capacity_blocks:
            dropped, _ = self._blocks.popitem(last=False)
            self._note(dropped, False)
            self.num_dropped += 1

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block, marked most recently used; None when absent."""
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def num_leading(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        """How many of block_hashes[start:] are here, counted from `start` until the first absent one."""
        for i in range(start, len(block_hashes)):
            if block_hashes[i] not in self._blocks:
                return i - start
        return max(len(block_hashes) - start, 0)

    def discard(self, block_hash: bytes) -> None:
        if self._blocks.pop(block_hash, None) is not None:
            self._note(block_hash, False)

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) hashes since the last call, as a net change (see BlockManager.drain_events)."""
        stored = [h for h, is_stored in self._pending.items() if is_stored]
        removed = [h for h, is_stored in self._pending.items() if not is_stored]
        self._pending.clear()
        self._announced.update(stored)
        self._announced.difference_update(removed)
        return stored, removed

    def _note(self, block_hash: bytes, is_stored: bool) -> None:
        if (block_hash in self._announced) == is_stored:
            self._pending.pop(block_hash, None)  # back to what the consumer already knows
        else:
            self._pending[block_hash] = is_stored

"""HostTier: wires a HostBlockCache under an engine's device pool. Runs on the engine thread.

Eviction: the block manager names each computed block it is about to reuse (`on_evict`); the
copies are started in one batch (`flush`) before anything writes into the pool (a model step, a
block load), while the evicted slots still hold their KV. The copies go through the engine's
KvCopier: on a GPU the host keeps pinned views of a copy still under way on the side stream, and
reading them back is queued on that stream after it (engine/kv_copy.py): nothing here waits.
Promotion: before a request is admitted, the leading prompt blocks the pool lacks but the host
holds are written into free pool slots as cached blocks (`promote`), so the scheduler's prefix
match finds them like any local hit: host memory instead of Redis or a recompute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferry.engine.block_manager import BlockManager
from ferry.engine.host_cache import HostBlockCache
from ferry.engine.kv_copy import KvCopier
from ferry.engine.partial_blocks import tail_keys
from ferry.engine.sequence import Sequence as Seq


class HostTier:
    def __init__(self, cache: HostBlockCache, block_manager: BlockManager, copier: KvCopier) -> None:
        self.cache = cache
        self.block_manager = block_manager
        self.copier = copier
        self._evicted: list[tuple[int, bytes]] = []
        block_manager.on_evict = self._on_evict

    def _on_evict(self, block_id: int, block_hash: bytes) -> None:
        self._evicted.append((block_id, block_hash))

    def flush(self) -> None:
        """Copy the blocks evicted since the last flush to the host; call before writing the pool."""
        if not self._evicted:
            return
        copy = self.copier.copy_out([block_id for block_id, _ in self._evicted], keep_pinned=True)
        assert copy.buffer is not None, "host-tier copies always land in host memory"
        for (_, block_hash), block in zip(self._evicted, copy.buffer):  # [*block_shape] views, landing
            self.cache.put(block_hash, block, owned=True)
        self._evicted.clear()

    def promote(self, seq: Seq) -> int:
        """Load the prompt's leading blocks that only the host holds into free pool slots, and the
        partial block that follows them when only the host holds it (engine/partial_blocks.py); how
        many. Hashes the sequence's blocks once, in seq.block_hashes, where admission finds them."""
        bm = self.block_manager
        bm.extend_hashes(seq)
        hashes = seq.block_hashes[: (seq.num_tokens - 1) // bm.block_size]
        num_device = bm.num_leading_cached(hashes)
        num_host = self.cache.num_leading(hashes, num_device)
        # only as many as the free list holds beyond this prompt's own cached blocks: a longer run
        # would evict the first promoted blocks (or the prompt's own) to make room for the last
        num_host = min(num_host, bm.num_free_blocks - num_device)
        block_ids: list[int] = []
        blocks: list[torch.Tensor] = []
        if num_host > 0:
            bm.touch(hashes[:num_device])
            for block_hash in hashes[num_device : num_device + num_host]:
                if not self._adopt(block_hash, block_ids, blocks):
                    break
        num_leading = num_device + len(block_ids)
        if num_leading == num_device + max(num_host, 0) and bm.num_free_blocks > num_leading:
            partial = self._partial_key(seq, num_leading)
            if partial is not None:
                self._adopt(partial, block_ids, blocks)
        if not block_ids:
            return 0
        self.flush()  # the adopted slots' previous blocks go to the host before they are overwritten
        self.copier.write(block_ids, blocks)
        self.cache.num_hits += len(block_ids)
        return len(block_ids)

    def _partial_key(self, seq: Seq, num_full: int) -> bytes | None:
        """The name of the partial block after `seq`'s first `num_full` blocks that the host holds and the
        pool does not (None also when the pool has one: admission copies it from there)."""
        bm = self.block_manager
        if bm.on_copy is None or not len(self.cache):
            return None
        for _, key in tail_keys(seq.token_ids, seq.block_hashes, num_full, bm.block_size):
            if bm.num_leading_cached([key]):
                return None
            if key in self.cache:
                return key
        return None

    def _adopt(self, block_hash: bytes, block_ids: list[int], blocks: list[torch.Tensor]) -> bool:
        block_id = self.block_manager.adopt(block_hash)
        if block_id is None:
            return False
        block_ids.append(block_id)
        block = self.cache.get(block_hash)
        assert block is not None, "a hash the lookup counted left the host tier before it was adopted"
        blocks.append(block)
        return True

    def keep(self, block_hashes: Sequence[bytes], data: torch.Tensor) -> int:
        """Fetched blocks ([n, *block_shape]) into host memory, unless the pool or the host has them
        already; how many were new. They reach the pool when a request that needs them is admitted."""
        num_new = 0
        for block_hash, block in zip(block_hashes, data):
            if self.block_manager.num_leading_cached([block_hash]) or block_hash in self.cache:
                continue
            self.cache.put(block_hash, block)
            num_new += 1
        return num_new

    def num_leading(self, block_hashes: Sequence[bytes], start: int) -> int:
        return self.cache.num_leading(block_hashes, start)

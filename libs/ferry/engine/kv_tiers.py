"""KvTiers: what an engine's KV pool and host tier hold, for the workers that route, prefetch and
write back blocks (a mixin of LLMEngine: it uses its block manager, host tier and KV cache).
Everything here runs on the engine thread, except the read-only lookups noted as safe elsewhere."""

from __future__ import annotations

from collections import OrderedDict

import torch

from ferry.engine.block_manager import BlockManager
from ferry.engine.host_tier import HostTier
from ferry.engine.kv_copy import KvCopier, OutCopy


class KvTiers:
    block_manager: BlockManager
    host: HostTier | None
    copier: KvCopier
    _finished_chains: OrderedDict[str, tuple[list[bytes], bytes | None]]
    _max_finished_chains: int

    def remember_finished(self, max_sequences: int) -> None:
        """Keep the block hashes of the last `max_sequences` finished sequences for take_finished_kv."""
        self._max_finished_chains = max_sequences

    def take_finished_kv(self, request_id: str, skip_blocks: int = 0) -> tuple[list[bytes], OutCopy] | None:
        """(hashes, copy to the host of [n, *block_shape]) of a finished sequence's full blocks after
        the first `skip_blocks`, as far as the pool still holds them; None when it holds none (or it
        was not kept). The copy is under way (OutCopy.result); the caller's I/O side waits for it."""
        chain, _ = self._finished_chains.pop(request_id, ([], None))
        block_ids = self.block_manager.cached_block_ids(chain[skip_blocks:])
        if not block_ids:
            return None
        return chain[skip_blocks : skip_blocks + len(block_ids)], self.copier.copy_out(block_ids)

    def take_finished_chain(
        self, request_id: str, skip_blocks: int = 0
    ) -> tuple[list[bytes], OutCopy, bytes | None] | None:
        """Like take_finished_kv, with the whole chain and the partial last block: (hashes of every
        leading full block as far as the pool holds them, copy of those after the first `skip_blocks`
        followed by the partial block, the partial block's name or None). The partial block comes
        only when the pool still holds it and the whole chain (engine/partial_blocks.py)."""
        chain, partial = self._finished_chains.pop(request_id, ([], None))
        bm = self.block_manager
        block_ids = bm.cached_block_ids(chain[skip_blocks:])
        if partial is not None and len(block_ids) == len(chain[skip_blocks:]) and bm.num_leading_cached([partial]):
            block_ids.extend(bm.cached_block_ids([partial]))
        else:
            partial = None
        if not block_ids:
            return None
        num_full = len(block_ids) - (partial is not None)
        return chain[: skip_blocks + num_full], self.copier.copy_out(block_ids), partial

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of this chained-hash list are here now, in the pool or the host tier."""
        return sum(self.cached_tiers(block_hashes))

    def cached_tiers(self, block_hashes: list[bytes]) -> tuple[int, int]:
        """(device, host): the leading blocks computed in the pool, then the next ones in host memory."""
        num_device = self.block_manager.num_leading_cached(block_hashes)
        num_host = self.host.num_leading(block_hashes, num_device) if self.host is not None else 0
        return num_device, num_host

    def drain_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) block hashes of the device pool since the last call."""
        return self.block_manager.drain_events()

    def cached_hashes(self) -> tuple[list[bytes], list[bytes]]:
        """(device, host): every block hash the pool (computed) and the host tier hold now."""
        host = list(self.host.cache.hashes()) if self.host is not None else []
        return self.block_manager.cached_hashes(), host

    def drain_host_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) block hashes of the host tier since the last call."""
        return self.host.cache.drain_events() if self.host is not None else ([], [])

    def prefetch_to_host(self, block_hashes: list[bytes], data: torch.Tensor) -> int:
        """Keep fetched blocks ([n, *block_shape]) in the host tier; how many were new (HostTier.keep)."""
        return self.host.keep(block_hashes, data) if self.host is not None else 0

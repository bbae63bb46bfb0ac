"""`KvStore`: put, get and look up chains of KV blocks for one model namespace.

Bulk bytes go straight between a worker and the transport in one batch per call (one pipeline on
Redis), never one round trip per block. A miss is an answer (`None`, or a shorter count), never an
exception; only an unreachable backend raises (`KvStoreUnavailable`), so the caller can recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferry.kvstore.codec import BlockCorrupt, BlockMismatch, check_block, copy_payload, encode_header, tensor_bytes
from ferry.kvstore.keys import block_key
from ferry.kvstore.transport import KvTransport, num_leading_present

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KvStoreStats:
    """This client's counters since it was created."""

    num_blocks_put: int = 0
    num_bytes_put: int = 0
    num_gets: int = 0
    num_get_misses: int = 0
    """get_blocks calls that answered None (absent, corrupt or mismatched blocks)."""
    num_blocks_got: int = 0
    num_bytes_got: int = 0
    num_corrupt_blocks: int = 0
    """Damaged blocks found (and deleted) by get_blocks."""
    num_lookups: int = 0
    num_lookup_blocks: int = 0
    num_lookup_hits: int = 0

    @property
    def lookup_hit_rate(self) -> float:
        return self.num_lookup_hits / self.num_lookup_blocks if self.num_lookup_blocks else 0.0


class KvStore:
    """Blocks of one namespace (model fingerprint) on one transport."""

    def __init__(self, transport: KvTransport, namespace: str) -> None:
        if not namespace:
            raise ValueError("namespace must not be empty")
        self.transport = transport
        self.namespace = namespace
        self._stats = KvStoreStats()

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        return [block_key(self.namespace, h) for h in hashes]

    async def put_blocks(self, hashes: Sequence[bytes], data: torch.Tensor) -> None:
        """Store data[i] (one block, [*block_shape]) under hashes[i]; data is [n, *block_shape]."""
        if data.dim() < 1 or data.shape[0] != len(hashes):
            raise ValueError(f"data has shape {tuple(data.shape)}, expected [{len(hashes)}, *block_shape]")
        keys = self.keys(hashes)
        raw = memoryview(tensor_bytes(data))  # type: ignore[arg-type]  # [n * block_bytes]; numpy stubs lack __buffer__
        block_bytes = len(raw) // max(len(hashes), 1)
        block_shape = tuple(data.shape[1:])
        items = []
        for i, (key, block_hash) in enumerate(zip(keys, hashes)):
            payload = raw[i * block_bytes : (i + 1) * block_bytes]
            header = encode_header(self.namespace, data.dtype, block_shape, payload, block_hash)
            items.append((key, header + payload))
        await self.transport.set_many(items)
        self._stats.num_blocks_put += len(items)
        self._stats.num_bytes_put += len(raw)

    async def get_blocks(
        self,
        hashes: Sequence[bytes],
        dtype: torch.dtype | None = None,
        block_shape: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """[n, *block_shape] CPU tensor of every block, or None when any block is not usable."""
        shape = tuple(block_shape) if block_shape is not None else None
        if not hashes:
            if dtype is None or shape is None:
                raise ValueError("get_blocks of no hashes needs dtype and block_shape")
            return torch.empty((0, *shape), dtype=dtype)
        keys = self.keys(hashes)
        values = await self.transport.get_many(keys)
        self._stats.num_gets += 1
        out = await self._decode_all(keys, hashes, values, dtype, shape)
        if out is None:
            self._stats.num_get_misses += 1
        else:
            self._stats.num_blocks_got += len(keys)
            self._stats.num_bytes_got += out.numel() * out.element_size()
        return out

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain are stored."""
        num_leading = await num_leading_present(self.transport, self.keys(hashes))
        self._stats.num_lookups += 1
        self._stats.num_lookup_blocks += len(hashes)
        self._stats.num_lookup_hits += num_leading
        return num_leading

    async def num_leading_stored(self, hashes: Sequence[bytes]) -> int:
        """As `lookup`, for a writer that skips what is stored: not counted as a prefix lookup."""
        return await num_leading_present(self.transport, self.keys(hashes))

    def stats(self) -> KvStoreStats:
        s = self._stats
        return KvStoreStats(**{name: getattr(s, name) for name in KvStoreStats.__slots__})

    async def _decode_all(self, keys, hashes, values, dtype, shape) -> torch.Tensor | None:
        if any(v is None for v in values):
            return None
        out = None
        for i, (key, block_hash, value) in enumerate(zip(keys, hashes, values)):
            try:
                dtype, shape, offset = check_block(value, self.namespace, dtype, shape, block_hash)
            except BlockCorrupt as exc:
                await self._reject(key, exc)
                return None
            if out is None:  # the first block fixes dtype and shape for the rest
                out = torch.empty((len(keys), *shape), dtype=dtype)  # [n, *block_shape]
            copy_payload(value, offset, out[i])
        return out

    async def _reject(self, key: str, exc: BlockCorrupt) -> None:
        if isinstance(exc, BlockMismatch):
            log.warning("kv block %s not loaded: %s", key, exc)
            return
        # A damaged block would keep counting as a lookup hit and keep missing; drop it.
        self._stats.num_corrupt_blocks += 1
        log.warning("kv block %s is damaged (%s); treated as a miss and deleted", key, exc)
        await self.transport.delete_many([key])

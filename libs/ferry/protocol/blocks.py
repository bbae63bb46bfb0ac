"""Chained KV-block hashes, identical in every process.

A block's hash covers its parent's hash, its token ids and any extra keys (adapter, salt), so a
hash names the whole prefix up to and including the block. sha256 over a canonical msgpack
encoding, truncated to 16 bytes: deterministic across processes and machines (unlike Python's
`hash`), and collisions are out of reach for a cache. The engine's block manager, the workers
and the KV store all use these functions; the store prefixes keys with a model fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack

HASH_BYTES = 16
ROOT_HASH = hashlib.sha256(b"ferry-kv-root-v1").digest()[:HASH_BYTES]
"""Parent of the first block; the same seed in every process."""


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[object] = ()) -> bytes:
    """Hash of one block given its parent's hash (None for the first block)."""
    payload = msgpack.packb(
        [parent if parent is not None else ROOT_HASH, list(token_ids), list(extra_keys)],
        use_bin_type=True,
    )
    return hashlib.sha256(payload).digest()[:HASH_BYTES]


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra_keys: Sequence[object] = ()) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


PARTIAL_BLOCK_KEY = "partial"
"""Extra hash key of a trailing partial block: its hash never equals a full block's."""


def hash_partial_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of a block that holds only `token_ids` (fewer than a block's tokens) after `parent`: the
    key of a sequence's trailing partial block, in the engine's prefix cache, its host tier and the
    store. A later prompt that extends exactly these tokens finds it by trying each length."""
    return hash_block(parent, token_ids, [PARTIAL_BLOCK_KEY])

"""Block-hash chains as both balancers read them: how far from the start a holder has a chain.

Pure (no NATS, Redis or torch). A chain's block hash covers every token before it, so only a run of
held blocks from the start is usable: a later block without the earlier ones is recomputed anyway.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def num_leading_held(held: Container[bytes] | None, block_hashes: Sequence[bytes]) -> int:
    """How many of the chain's blocks, from the first, are in `held` (None or empty: 0)."""
    if not held:
        return 0
    for i, block_hash in enumerate(block_hashes):
        if block_hash not in held:
            return i
    return len(block_hashes)

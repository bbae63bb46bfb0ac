"""Trailing partial blocks: the KV of a sequence's last, not yet full block, kept for reuse. No torch.

Only full blocks are named by their chained hash, so a finished sequence's last 1..block_size-1 tokens
were recomputed by any later prompt that extends them, and in a conversation every turn does: turn k+1
re-sends turn k's prompt and answer, whose last block is partial (the answer's tail). A partial block is
named by `hash_partial_block(parent, its tokens)` (never a full block's hash) when its sequence frees it
(BlockManager.free), goes to the host tier and the store under that name like any block, and a prompt
whose tokens after its cached full blocks start with exactly those tokens finds it by trying each length
(`tail_keys`, longest first: at most block_size - 1 hashes of a few µs each).

A new sequence never writes into a shared partial block: admission copies its KV into a fresh block of
the sequence (copy-on-write, `BlockManager.on_copy`), which the sequence fills and names as usual.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ferry.protocol import hash_partial_block


def partial_key(
    token_ids: Sequence[int], block_hashes: Sequence[bytes], num_full: int, num_tokens: int, block_size: int
) -> bytes:
    """The name of a partial block holding the `num_tokens` tokens of `token_ids` after its first
    `num_full` full blocks (whose chained hashes `block_hashes` holds at least)."""
    parent = block_hashes[num_full - 1] if num_full else None
    start = num_full * block_size
    return hash_partial_block(parent, token_ids[start : start + num_tokens])


def tail_keys(
    token_ids: Sequence[int], block_hashes: Sequence[bytes], num_full: int, block_size: int
) -> Iterator[tuple[int, bytes]]:
    """(num_tokens, key) of every partial block that could follow the first `num_full` full blocks of
    `token_ids` and leave at least one token to compute (the step needs one for its logits), longest
    first. `block_hashes` holds at least those `num_full` blocks' chained hashes."""
    longest = min(block_size - 1, len(token_ids) - 1 - num_full * block_size)
    for num_tokens in range(longest, 0, -1):
        yield num_tokens, partial_key(token_ids, block_hashes, num_full, num_tokens, block_size)

"""KV block accounting: reference counts, chained-hash prefix cache, LRU eviction. No torch.

A block holds `block_size` tokens of KV. A full block whose KV is computed is named by the
chained hash of its prefix (ferry.protocol.hash_block) and stays findable after its last owner
frees it, until a fresh allocation evicts it (least recently freed first). Full prompt blocks
are named at allocation, before their KV exists ("pending"): a second sequence that would hit a
pending block waits one step instead of computing the same prefix again. A sequence's trailing
partial block is named too when the sequence frees it, and a later prompt that extends its tokens
gets a copy of it (engine/partial_blocks.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ferry.engine import partial_blocks
from ferry.engine.partial_blocks import tail_keys
from ferry.engine.sequence import Sequence
from ferry.protocol import hash_block


@dataclass(slots=True)
class PrefixMatch:
    block_ids: list[int]
    """Cached, computed blocks that cover the sequence's leading tokens."""
    is_pending: bool
    """The next block is being computed by another sequence right now: better to wait."""
    tail: tuple[int, int] | None = None
    """(block id, tokens) of a cached partial block holding the tokens right after `block_ids`: its KV
    is copied into the sequence's next block at allocation (partial_blocks.py)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._is_computed = [False] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        """Blocks nobody holds; the front is evicted first."""
        self._pending: dict[bytes, bool] = {}
        """Net pool changes since the last drain: hash -> True stored / False removed."""
        self._announced: set[bytes] = set()
        """Hashes the last drains reported as stored. With `_pending` this keeps the event state
        under 2 x num_blocks entries even when nobody drains (a decode-only engine)."""
        self.num_hit_tokens = 0
        """Tokens served from the prefix cache at admissions, since start."""
        self.on_evict: Callable[[int, bytes], None] | None = None
        """Called with (block id, hash) when a computed cached block is about to be reused, while its
        KV is still intact: the engine's host tier keeps a copy (engine/host_tier.py)."""
        self.on_copy: Callable[[int, int], None] | None = None
        """Copies one block's KV into another (src, dst), at once: set by the engine. Without it a
        cached partial block is never matched (its KV could not be copied)."""
        self.num_tail_hit_tokens = 0
        """Of num_hit_tokens, those copied from cached partial blocks."""

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Computed blocks findable by hash (held or free)."""
        return sum(1 for b in self._hash_to_block.values() if self._is_computed[b])

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_leading_cached(self, block_hashes: list[bytes]) -> int:
        """Leading hashes whose blocks are computed here (held or free)."""
        if not self.enable_prefix_caching:
            return 0
        for i, block_hash in enumerate(block_hashes):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None or not self._is_computed[block_id]:
                return i
        return len(block_hashes)

    def cached_hashes(self) -> list[bytes]:
        """Every computed block's hash findable here (held or free)."""
        return [h for h, b in self._hash_to_block.items() if self._is_computed[b]]

    def cached_block_ids(self, block_hashes: list[bytes]) -> list[int]:
        """Pool blocks of the leading hashes that are computed here (held or free)."""
        block_ids = []
        for block_hash in block_hashes[: self.num_leading_cached(block_hashes)]:
            block_ids.append(self._hash_to_block[block_hash])
        return block_ids

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) hashes of computed cached blocks since the last call, as a net change:
        a block stored and evicted between two calls is never reported."""
        stored = [h for h, is_stored in self._pending.items() if is_stored]
        removed = [h for h, is_stored in self._pending.items() if not is_stored]
        self._pending.clear()
        self._announced.update(stored)
        self._announced.difference_update(removed)
        return stored, removed

    def _note_stored(self, block_hash: bytes) -> None:
        if block_hash in self._announced:
            self._pending.pop(block_hash, None)  # back to what the consumer already knows
        else:
            self._pending[block_hash] = True

    def _note_removed(self, block_hash: bytes) -> None:
        if block_hash in self._announced:
            self._pending[block_hash] = False
        else:
            self._pending.pop(block_hash, None)  # the consumer never heard of it

    # ---- admission -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        if not self.enable_prefix_caching:
            return PrefixMatch([], False)
        self.extend_hashes(seq)
        max_hits = (seq.num_tokens - 1) // self.block_size  # leave >= 1 token to compute logits
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_hits]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            if not self._is_computed[block_id]:
                return PrefixMatch(hits, True)
            hits.append(block_id)
        return PrefixMatch(hits, False, self._match_tail(seq, len(hits)))

    def _match_tail(self, seq: Sequence, num_hits: int) -> tuple[int, int] | None:
        if self.on_copy is None:
            return None
        for num_tokens, key in tail_keys(seq.token_ids, seq.block_hashes, num_hits, self.block_size):
            block_id = self._hash_to_block.get(key)
            if block_id is not None and self._is_computed[block_id]:
                return block_id, num_tokens
        return None

    def num_blocks_taken(self, seq: Sequence, match: PrefixMatch | None = None) -> int:
        """Free-list blocks allocate(seq, match) would take: fresh ones plus cached hits nobody holds."""
        hits = match.block_ids if match else []
        num_hits_free = sum(1 for b in hits if self._ref_counts[b] == 0)
        if match is not None and match.tail is not None and self._ref_counts[match.tail[0]] == 0:
            num_hits_free += 1  # held while the fresh blocks are taken, so none of them is the tail itself
        return self.blocks_for(seq.num_tokens) - len(hits) + num_hits_free

    def allocate(self, seq: Sequence, match: PrefixMatch | None = None) -> bool:
        """Give `seq` blocks for all its tokens, reusing `match`; False (nothing changed) if short."""
        assert not seq.block_ids, f"{seq.request_id} already holds blocks"
        hits = match.block_ids if match else []
        num_new = self.blocks_for(seq.num_tokens) - len(hits)
        if self.num_blocks_taken(seq, match) > len(self._free):
            return False
        tail = match.tail if match else None
        for block_id in hits + ([tail[0]] if tail else []):
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        seq.block_ids = hits + [self._take_fresh() for _ in range(num_new)]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        if tail is not None:  # copy-on-write: the sequence appends to its own copy of the partial block
            assert self.on_copy is not None
            self.on_copy(tail[0], seq.block_ids[len(hits)])
            self._unhold(tail[0])
            seq.num_computed_tokens = seq.num_cached_tokens = seq.num_computed_tokens + tail[1]
            self.num_tail_hit_tokens += tail[1]
        self.num_hit_tokens += seq.num_cached_tokens
        self._name_pending(seq)
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones; False if short."""
        num_needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        if num_needed > len(self._free):
            return False
        for _ in range(num_needed):
            seq.block_ids.append(self._take_fresh())
        return True

    def touch(self, block_hashes: list[bytes]) -> None:
        """Make the free cached blocks of these hashes the last to be evicted."""
        for block_hash in block_hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is not None and block_id in self._free:
                self._free.move_to_end(block_id)

    def adopt(self, block_hash: bytes) -> int | None:
        """A free slot named `block_hash` and counted as computed, for KV the caller writes into it
        now (loaded from the host tier); None when the hash is known here or no slot is free. The
        block stays free (most recently used end), so a later admission finds it like any cached one."""
        if not self.enable_prefix_caching or block_hash in self._hash_to_block or not self._free:
            return None
        block_id = self._take_fresh()
        self._ref_counts[block_id] = 0
        self._is_computed[block_id] = True
        self._name(block_id, block_hash)
        self._note_stored(block_hash)
        self._free[block_id] = None
        return block_id

    # ---- progress and release ------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Mark the blocks filled by computed tokens as computed and offer them to the cache."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if num_full <= seq.num_committed_blocks:
            return
        if self.enable_prefix_caching:
            self.extend_hashes(seq)
        for i in range(seq.num_committed_blocks, num_full):
            block_id = seq.block_ids[i]
            if self._is_computed[block_id]:
                continue
            self._is_computed[block_id] = True
            if self.enable_prefix_caching:
                self._name(block_id, seq.block_hashes[i])
                if self._hashes[block_id] is not None:
                    self._note_stored(seq.block_hashes[i])
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; tail blocks become the first to be evicted, except a computed
        trailing partial block, which stays cached under its partial name (partial_blocks.py)."""
        self._name_partial(seq)
        for block_id in reversed(seq.block_ids):
            self._unhold(block_id)
        seq.block_ids = []
        seq.num_committed_blocks = 0

    def partial_key(self, seq: Sequence) -> bytes | None:
        """The name of `seq`'s computed trailing partial block, None when it has none (its computed
        tokens end on a block boundary)."""
        num_full, num_tokens = divmod(seq.num_computed_tokens, self.block_size)
        if not num_tokens or not self.enable_prefix_caching:
            return None
        self.extend_hashes(seq)
        return partial_blocks.partial_key(seq.token_ids, seq.block_hashes, num_full, num_tokens, self.block_size)

    def _name_partial(self, seq: Sequence) -> None:
        """Name `seq`'s computed partial last block as a cached one, when `seq` alone holds it."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full >= len(seq.block_ids) or self._ref_counts[seq.block_ids[num_full]] != 1:
            return
        key = self.partial_key(seq)
        if key is None or key in self._hash_to_block:
            return
        block_id = seq.block_ids[num_full]
        pending = self._hashes[block_id]
        if pending is not None:  # named at admission for its full contents, which it never got
            if self._is_computed[block_id]:
                return
            del self._hash_to_block[pending]
            self._hashes[block_id] = None
        self._name(block_id, key)
        self._is_computed[block_id] = True
        self._note_stored(key)

    def _unhold(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self._ref_counts[block_id] == 0:
            self._release(block_id)

    # ---- internals -----------------------------------------------------------------------
    def extend_hashes(self, seq: Sequence) -> None:
        """Hash seq's full blocks that are not hashed yet (seq.block_hashes grows; earlier ones are kept)."""
        size, hashes, tokens = self.block_size, seq.block_hashes, seq.token_ids
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size]))

    def _name_pending(self, seq: Sequence) -> None:
        """Name the new full blocks now, so a twin prompt waits for them instead of recomputing."""
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_committed_blocks, min(len(seq.block_hashes), len(seq.block_ids))):
            self._name(seq.block_ids[i], seq.block_hashes[i])

    def _name(self, block_id: int, block_hash: bytes) -> None:
        if self._hashes[block_id] is None and block_hash not in self._hash_to_block:
            self._hashes[block_id] = block_hash
            self._hash_to_block[block_hash] = block_id

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            if self.on_evict is not None and self._is_computed[block_id]:
                self.on_evict(block_id, block_hash)
            del self._hash_to_block[block_hash]
            self._note_removed(block_hash)
            self._hashes[block_id] = None
        self._is_computed[block_id] = False
        self._ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None and self._is_computed[block_id]:
            self._free[block_id] = None  # most recently used end
            return
        if block_hash is not None:  # named but never computed: forget the name
            del self._hash_to_block[block_hash]
            self._hashes[block_id] = None
        self._is_computed[block_id] = False
        self._free[block_id] = None
        self._free.move_to_end(block_id, last=False)

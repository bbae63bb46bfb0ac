"""KvHandoff: sequences leaving an engine with their KV, and joining one with KV computed elsewhere
(a mixin of LLMEngine: it uses its scheduler, block manager, host tier and KV copier).

Disaggregated serving: a prefill-role engine hands each sequence on after its first token
(take_prefilled); a decode engine admits it with its blocks (add_prefilled); an engine shutting down
hands its unfinished sequences on (take_running). The blocks move through the KvCopier: taking
returns at once with the copy under way (the caller's I/O side waits for it), and adding accepts
blocks already staged on their way to the device (KvCopier.stage), so the engine thread never waits
for a copy, let alone for the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ferry.engine.block_manager import BlockManager
from ferry.engine.config import EngineConfig
from ferry.engine.host_tier import HostTier
from ferry.engine.kv_copy import InCopy, KvCopier
from ferry.engine.outputs import PrefilledKV
from ferry.engine.request_state import RequestState
from ferry.engine.sequence import Sequence
from ferry.protocol import SamplingParams, hash_full_blocks

if TYPE_CHECKING:
    from ferry.engine.scheduler import Scheduler


class KvHandoff:
    config: EngineConfig
    block_manager: BlockManager
    scheduler: Scheduler
    host: HostTier | None
    copier: KvCopier
    _requests: dict[str, RequestState]
    _pinned: dict[str, RequestState]
    _new_state: Callable[..., RequestState]

    def take_prefilled(self, request_id: str) -> PrefilledKV:
        """The KV of a prefill-role request after its first token; its blocks are released."""
        return self._copy_out(self._pinned.pop(request_id).seq)

    def take_running(self, request_id: str) -> tuple[PrefilledKV, list[int]]:
        """Take an unfinished request out to continue in another engine (its worker shuts down):
        the KV of its computed tokens and every output token so far; its blocks are released.
        KeyError if it is not here (finished, aborted, never added)."""
        seq = self._requests.pop(request_id).seq
        self.scheduler.detach(seq)
        return self._copy_out(seq), list(seq.output_token_ids)

    def _copy_out(self, seq: Sequence) -> PrefilledKV:
        """The KV of `seq`'s computed tokens on its way to the host, then its blocks freed (the copy
        was queued before any later step can reuse them)."""
        num_tokens = seq.num_computed_tokens
        block_ids = seq.block_ids[: self.block_manager.blocks_for(num_tokens)]
        copy = self.copier.copy_out(block_ids)
        hashes = seq.block_hashes[: num_tokens // self.config.block_size]
        if len(hashes) < num_tokens // self.config.block_size:  # not kept without prefix caching
            hashes = hash_full_blocks(seq.token_ids[:num_tokens], self.config.block_size)
        self.block_manager.free(seq)
        return PrefilledKV(block_ids, hashes, num_tokens, copy)

    def can_admit(self, num_tokens: int) -> bool:
        """Room for a sequence of num_tokens (+1 to decode) now, in blocks and in the batch cap."""
        num_seqs = len(self.scheduler.running) + len(self.scheduler.waiting)
        return (
            num_seqs < self.scheduler.max_num_seqs
            and self.block_manager.blocks_for(num_tokens + 1) <= self.block_manager.num_free_blocks
        )

    def stage_kv(self, data: torch.Tensor) -> InCopy:
        """Start moving fetched blocks [n, *block_shape] to the pool's device; any thread (the I/O
        side calls it as they arrive, so the copy overlaps the engine's steps). For add_prefilled."""
        return self.copier.stage(data)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        sampling: SamplingParams,
        kv_data: torch.Tensor | InCopy,
        num_kv_tokens: int,
        count_as_cached: bool = False,
    ) -> None:
        """Join a sequence whose first num_kv_tokens tokens' KV is kv_data [n, *block_shape] (a host
        tensor, or one staged by stage_kv).

        count_as_cached: the KV is a reused prefix (from the store), not this request's own
        hand-off, so it counts in num_cached_tokens like a local prefix-cache hit."""
        state = self._new_state(request_id, prompt_token_ids, output_token_ids, sampling, None)
        seq = state.seq
        num_kv_blocks = self.block_manager.blocks_for(num_kv_tokens)
        if not 1 <= num_kv_tokens < seq.num_tokens:
            raise ValueError(f"num_kv_tokens={num_kv_tokens}: must be in [1, {seq.num_tokens - 1}]")
        if kv_data.shape[0] != num_kv_blocks:
            raise ValueError(f"kv_data: {kv_data.shape[0]} blocks, {num_kv_tokens} tokens need {num_kv_blocks}")
        if not self.block_manager.allocate(seq):
            raise RuntimeError(f"{request_id}: no room for {seq.num_tokens} tokens (check can_admit first)")
        if self.host is not None:
            self.host.flush()
        self.copier.write(seq.block_ids[:num_kv_blocks], kv_data)
        seq.num_computed_tokens = num_kv_tokens
        if count_as_cached:
            seq.num_cached_tokens = num_kv_tokens
            self.block_manager.num_hit_tokens += num_kv_tokens
        self.block_manager.commit(seq)  # full blocks join the prefix cache: later local requests hit
        self._requests[request_id] = state
        self.scheduler.add_running(seq)

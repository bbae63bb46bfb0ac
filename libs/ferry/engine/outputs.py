"""What the engine hands back: per-step request outputs, stats, and prefilled KV for handoff."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ferry.protocol import TokenLogprob

if TYPE_CHECKING:
    from ferry.engine.kv_copy import OutCopy


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    index: int
    """Position of new_token_ids[0] in the request's output (prior output tokens included)."""
    new_token_ids: list[int]
    text: str
    """Text delta of these tokens: never half a UTF-8 character, stop strings removed."""
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    """None while running; 'stop', 'length' or 'abort' on the last output."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    """Prompt tokens admitted or waiting whose KV is not computed yet."""
    kv_blocks_used: int
    kv_blocks_total: int
    num_computed_tokens: int
    """Tokens run through the model since start (prefill chunks + decodes + recomputation)."""
    num_cached_tokens: int
    """Tokens whose KV came from the prefix cache instead of being computed, since start."""
    num_preemptions: int
    num_steps: int
    num_generated_tokens: int
    num_pinned: int
    """Prefill-role sequences whose KV waits for take_prefilled."""
    mean_batch_size: float
    """Sequences per model step, averaged since start."""
    num_host_blocks: int = 0
    """Blocks in the host tier now (0 without one)."""
    num_host_hit_blocks: int = 0
    """Blocks loaded back into the pool from the host tier at admissions, since start."""
    num_partial_hit_tokens: int = 0
    """Of num_cached_tokens, those copied from cached partial blocks (engine/partial_blocks.py)."""

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


@dataclass(slots=True)
class PrefilledKV:
    block_ids: list[int]
    """Blocks that held the KV in this engine (already released when you read this)."""
    block_hashes: list[bytes]
    """Chained hashes of the full blocks (a trailing partial block has none)."""
    num_tokens: int
    """Tokens covered by data (the prompt, plus prior output tokens if any)."""
    copy: OutCopy
    """The blocks on their way to the host (KvCopier.copy_out): an I/O side awaits copy.result()."""

    @property
    def data(self) -> torch.Tensor:
        """[len(block_ids), *block_shape] on the host; waits for the copy (not on the engine thread)."""
        return self.copy.wait()

"""Sequence: one request's tokens, KV blocks and progress inside the engine. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ferry.protocol import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    """Prompt followed by every generated token (including ones generated before a migration)."""
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float = 0.0
    num_prior_output_tokens: int = 0
    """Output tokens that came with the request (migration / prefilled handoff); not re-emitted."""
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    """Leading tokens whose KV is in this sequence's blocks."""
    num_cached_tokens: int = 0
    """Tokens found in the prefix cache at the last admission."""
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the leading full blocks of token_ids (computed or not)."""
    num_committed_blocks: int = 0
    """Leading blocks the block manager has marked computed (and offered to the prefix cache)."""
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    max_num_tokens: int | None = None
    """Prompt + output never grow past this (the engine caps max_tokens by the model's context);
    None: prompt + sampling.max_tokens. Static batching reserves KV for this many tokens."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill_done(self) -> bool:
        """Only the last sampled token is missing from the cache: the next step is a decode."""
        return self.num_computed_tokens >= len(self.token_ids) - 1

    @property
    def num_tokens_limit(self) -> int:
        return self.max_num_tokens or self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

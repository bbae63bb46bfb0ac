"""What a worker sends: token events batched per gateway, and the block list of a hand-off. Pure.

One engine step yields outputs for many requests from many gateways; they go out as one
`OutputBatch` per gateway per step (fewer, larger messages than one per token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ferry.protocol import BlockRef, GenerateRequest, OutputBatch, TokenEvent, TokenLogprob, hash_partial_block


class Output(Protocol):
    """The fields of `ferry.engine.RequestOutput` a token event needs."""

    request_id: str
    """The engine's id of the sequence (one per attempt: see ledger.engine_id)."""
    index: int
    new_token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_prompt_tokens: int


def token_event(out: Output, request: GenerateRequest) -> TokenEvent:
    return TokenEvent(
        request_id=request.request_id,
        index=out.index,
        token_ids=list(out.new_token_ids),
        text=out.text,
        logprobs=out.logprobs,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        attempt=request.attempt,  # the gateway drops events of attempts it migrated away from
    )


def batch_by_gateway(
    outputs: Iterable[Output], owner: Callable[[str], GenerateRequest | None], worker_id: str
) -> dict[str, OutputBatch]:
    """One OutputBatch per gateway. `owner` maps an output's engine id to the request attempt it
    belongs to; outputs of attempts this worker no longer holds (cancelled, replaced) are dropped."""
    batches: dict[str, OutputBatch] = {}
    for out in outputs:
        request = owner(out.request_id)
        if request is None:
            continue  # cancelled or replaced while the step ran
        batch = batches.get(request.gateway_id)
        if batch is None:
            batch = batches[request.gateway_id] = OutputBatch(worker_id=worker_id)
        batch.tokens.append(token_event(out, request))
    return batches


def handoff_blocks(
    token_ids: Sequence[int], num_kv_tokens: int, block_size: int, full_hashes: Sequence[bytes]
) -> tuple[list[bytes], list[BlockRef]]:
    """Store keys and `BlockRef`s of the KV of `token_ids[:num_kv_tokens]`.

    Full blocks keep their chained prefix hashes (so they double as prefix cache); a trailing
    partial block is keyed by the same chain plus a 'partial' marker."""
    num_full = num_kv_tokens // block_size
    if len(full_hashes) < num_full:
        raise ValueError(f"full_hashes: {len(full_hashes)} given, {num_kv_tokens} tokens need {num_full}")
    hashes = list(full_hashes[:num_full])
    refs = [BlockRef(h, block_size) for h in hashes]
    tail = num_kv_tokens - num_full * block_size
    if tail:
        parent = hashes[-1] if hashes else None
        tail_tokens = token_ids[num_full * block_size : num_kv_tokens]
        hashes.append(hash_partial_block(parent, tail_tokens))
        refs.append(BlockRef(hashes[-1], tail))
    return hashes, refs

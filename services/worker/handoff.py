"""Handing a sequence on: its KV to the store, then a `Handoff` offered on `ferry.handoff` until a
decode-balancer accepts it. The prefill worker hands on every prefilled sequence; a decode worker
that shuts down hands on the sequences it could not finish in time (the balancer places them on
another decode worker, which continues them from the same tokens and KV).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from tenacity import AsyncRetrying, RetryCallState, retry_if_result, stop_any, stop_before_delay, wait_exponential
from tenacity.stop import stop_base

from ferry.kvstore import KvStoreError
from ferry.protocol import (
    HANDOFF_TOO_LONG,
    GenerateRequest,
    Handoff,
    HandoffReply,
    ProtocolError,
    decode,
    encode,
    subjects,
)
from ferry_services.worker.events import handoff_blocks

log = logging.getLogger(__name__)

HANDOFF_REQUEST_TIMEOUT_S = 5.0
"""One offer waits this long for a decode-balancer's answer."""
FIRST_RETRY_DELAY_S = 0.05
MAX_RETRY_DELAY_S = 1.0
"""Offers back off exponentially from the first delay up to this one."""


class HandoffSender:
    def __init__(
        self,
        nc: Client,
        store,
        worker_id: str,
        block_size: int,
        is_cancelled: Callable[[str], bool],
        skip_stored: bool = True,
    ) -> None:
        self.nc = nc
        self.store = store
        self.worker_id = worker_id
        self.block_size = block_size
        self.is_cancelled = is_cancelled
        self.skip_stored = skip_stored
        """Write only the blocks after the chain's leading ones the store holds (FERRY_HANDOFF_SKIP_STORED)."""
        self.num_accepted = 0
        self.num_kv_store_failures = 0
        self.num_blocks_skipped = 0
        """Hand-off blocks not written because the store held them already."""

    async def send(self, request: GenerateRequest, new_token_ids: list[int], kv, timeout_s: float) -> str:
        """Store the KV (`PrefilledKV` of prompt + outputs so far), then offer the sequence with
        `new_token_ids` appended to its outputs; '' once a decode-balancer accepted it, else why not."""
        handoff = await self.store_kv(request, new_token_ids, kv)
        refusal = await self.offer(handoff, timeout_s)
        self.num_accepted += not refusal
        return refusal

    async def store_kv(self, request: GenerateRequest, new_token_ids: list[int], kv) -> Handoff:
        """Write the sequence's KV blocks; a store that fails means a hand-off without KV (recompute)."""
        onward = dataclasses.replace(request, output_token_ids=request.output_token_ids + list(new_token_ids))
        hashes, refs = handoff_blocks(onward.all_token_ids, kv.num_tokens, self.block_size, kv.block_hashes)
        num_kv_tokens = kv.num_tokens
        try:
            if hashes:  # the copy off the device started on the engine thread; it is waited for here
                await self.put_missing(hashes, kv)
        except KvStoreError as exc:
            self.num_kv_store_failures += 1
            log.warning("KV of %s not stored (%s): the next worker will recompute it", request.request_id, exc)
            refs, num_kv_tokens = [], 0
        return Handoff(
            request=onward,
            prefill_worker_id=self.worker_id,
            kv_namespace=self.store.namespace,
            kv_blocks=refs,
            num_kv_tokens=num_kv_tokens,
        )

    async def put_missing(self, hashes: list[bytes], kv) -> None:
        """Write the hand-off's blocks, less the chain's leading ones the store holds already (one EXISTS
        round trip): a conversation's next turn re-sends its history, whose blocks an earlier hand-off or
        write-back stored, and rewriting them (~260 KB a block on the bench model) costs this worker's
        CPU (and the GIL its engine thread needs) while the next prompt computes. A block evicted between
        this lookup and the decode worker's read is recomputed there, as any evicted block is."""
        num_stored = await self.store.num_leading_stored(hashes) if self.skip_stored else 0
        data = await kv.copy.result()
        self.num_blocks_skipped += num_stored
        if num_stored < len(hashes):
            await self.store.put_blocks(hashes[num_stored:], data[num_stored:])

    async def offer(self, handoff: Handoff, timeout_s: float) -> str:
        """Ask the decode-balancers, backing off exponentially, until one accepts ('' then), the request is
        cancelled, one says no decode worker could ever take it (HANDOFF_TOO_LONG), or the next try would
        start after `timeout_s`; else the last reason why not."""
        request_id = handoff.request.request_id
        retrying = AsyncRetrying(
            wait=wait_exponential(multiplier=FIRST_RETRY_DELAY_S, max=MAX_RETRY_DELAY_S),
            stop=stop_any(stop_before_delay(timeout_s), _StopIf(lambda: self.is_cancelled(request_id))),
            retry=retry_if_result(_worth_a_retry),  # a reason why not: try again, unless it is for good
            retry_error_callback=_last_result,  # gave up: the last reason
        )
        reason: str = await retrying(self._offer_once, handoff)
        if reason:
            log.warning("hand-off of %s not accepted: %s", request_id, reason)
        return reason

    async def _offer_once(self, handoff: Handoff) -> str:
        """'' when accepted, else why not."""
        try:
            reply = await self.nc.request(subjects.HANDOFF, encode(handoff), timeout=HANDOFF_REQUEST_TIMEOUT_S)
            answer = decode(reply.data)
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError):
            return "no decode-balancer answered"
        except ProtocolError as exc:
            return f"unreadable reply: {exc}"
        if isinstance(answer, HandoffReply):
            return "" if answer.accepted else answer.reason or "rejected"
        return f"{getattr(answer, 'code', '?')}: {getattr(answer, 'message', answer)}"


def _worth_a_retry(reason: str) -> bool:
    return bool(reason) and not reason.startswith(HANDOFF_TOO_LONG)


class _StopIf(stop_base):
    """Stop retrying once `predicate()` holds (checked after each failed try)."""

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self.predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.predicate()


def _last_result(retry_state: RetryCallState) -> str:
    assert retry_state.outcome is not None, "called after a try"
    return retry_state.outcome.result()

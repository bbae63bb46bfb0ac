"""Routes token events from `ferry.out.<gateway>` to the HTTP request waiting for them.

One queue per request in flight. A worker may repeat events (a retried publish, a migration that
replays a step); `TokenEvent.index` says where its tokens belong, so anything before the next
expected index is dropped and the client never sees a token twice. No NATS here: the bus layer
decodes `OutputBatch` and calls `deliver`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TypeAlias

from ferry.protocol import ErrorEvent, OutputBatch, TokenEvent


@dataclass(slots=True)
class Lost:
    """Not a wire message: the current attempt cannot finish (its worker is gone, or tokens went
    missing); `migration.py` resubmits the request."""

    request_id: str
    worker_id: str
    reason: str
    cause: str = "worker_lost"
    """Bounded, for the `reason` label of ferry_migrations_total: worker_silent, tokens_missing,
    bus_reconnect, worker_lost (a worker said so)."""


Event: TypeAlias = TokenEvent | ErrorEvent | Lost


@dataclass(slots=True)
class _Pending:
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    next_index: int = 0
    """Position in the output of the next token the client has not seen."""
    attempt: int = 0
    """Current `GenerateRequest.attempt`: events of older attempts are stale copies and dropped."""
    holder: str = ""
    """Worker that holds the current attempt: the prefill worker it was submitted to, then whoever sent tokens."""
    token_ids: list[int] = field(default_factory=list)
    """Every token queued for the client so far: a migration resubmits them as `output_token_ids`."""


class RequestTracker:
    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self.num_duplicates = 0
        self.num_orphans = 0
        self.num_stale = 0
        self.num_gaps = 0
        """Events of an attempt older than the current one (migrated away from): dropped."""
        """Events for requests that already ended (or never were ours): counted, not errors."""

    def __len__(self) -> int:
        return len(self._pending)

    def open(self, request_id: str) -> asyncio.Queue[Event]:
        assert request_id not in self._pending, request_id
        pending = self._pending[request_id] = _Pending()
        return pending.queue

    def close(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def get(self, request_id: str) -> _Pending | None:
        return self._pending.get(request_id)

    def deliver(self, batch: OutputBatch) -> None:
        for event in batch.tokens:
            self._deliver_tokens(event, batch.worker_id)
        for error in batch.errors:
            pending = self._pending.get(error.request_id)
            if pending is None:
                self.num_orphans += 1
            elif error.attempt < pending.attempt:
                self.num_stale += 1
            else:
                pending.queue.put_nowait(error)

    def _deliver_tokens(self, event: TokenEvent, worker_id: str) -> None:
        pending = self._pending.get(event.request_id)
        if pending is None:
            self.num_orphans += 1
            return
        if event.attempt < pending.attempt:
            self.num_stale += 1
            return
        if event.index < pending.next_index:
            self.num_duplicates += 1
            return
        if event.index > pending.next_index:  # tokens went missing: never show a gap, redo from here
            self.num_gaps += 1
            pending.attempt += 1  # whatever this attempt still sends is stale now
            pending.queue.put_nowait(
                Lost(event.request_id, worker_id, f"tokens {pending.next_index}.. missing", "tokens_missing")
            )
            return
        pending.holder = worker_id
        pending.next_index = event.index + len(event.token_ids)
        pending.token_ids += event.token_ids
        pending.queue.put_nowait(event)

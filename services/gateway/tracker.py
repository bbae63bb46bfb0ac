"""Routes token events from `ferry.out.<gateway>` to the HTTP request waiting for them.

One queue per request in flight. A worker may repeat events (a retried publish, a migration that
replays a step); `TokenEvent.index` says where its tokens belong, so anything before the next
expected index is dropped and the client never sees a token twice. No NATS here: the bus layer
decodes `OutputBatch` and calls `deliver`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ferry.protocol import ErrorEvent, OutputBatch, TokenEvent

Event = TokenEvent | ErrorEvent


@dataclass(slots=True)
class _Pending:
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    next_index: int = 0
    """Position in the output of the next token the client has not seen."""


class RequestTracker:
    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self.num_duplicates = 0
        self.num_orphans = 0
        """Events for requests that already ended (or never were ours): counted, not errors."""

    def __len__(self) -> int:
        return len(self._pending)

    def open(self, request_id: str) -> asyncio.Queue[Event]:
        assert request_id not in self._pending, request_id
        pending = self._pending[request_id] = _Pending()
        return pending.queue

    def close(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def deliver(self, batch: OutputBatch) -> None:
        for event in batch.tokens:
            self._deliver_tokens(event)
        for error in batch.errors:
            pending = self._pending.get(error.request_id)
            if pending is None:
                self.num_orphans += 1
            else:
                pending.queue.put_nowait(error)

    def _deliver_tokens(self, event: TokenEvent) -> None:
        pending = self._pending.get(event.request_id)
        if pending is None:
            self.num_orphans += 1
            return
        if event.index < pending.next_index:
            self.num_duplicates += 1
            return
        pending.next_index = event.index + len(event.token_ids)
        pending.queue.put_nowait(event)

"""Token events held back per stream for a few milliseconds, so that one message (and one SSE event at the
gateway, one read at the client) carries several tokens. Pure: the worker supplies the clock.

Every engine step yields one token per running sequence. Sent one by one, each token costs a msgpack
entry here, a decode, a queue hop, a JSON chunk and a socket write at the gateway, and a read and a JSON
parse at the client: on a 2-core box that CPU is taken from the engine's OpenMP threads (issue #22). With
`interval_s` > 0 a stream's events are merged (`TokenEvent` carries a list of tokens and their text) and
go out once the oldest held one has waited `interval_s`; what a user waits for does not wait:

- the first token of a request (index 0: TTFT) and the last (a finish reason) go out at once, with what
  was held before them;
- nothing is held longer than `interval_s` plus one engine step (the worker also flushes on a timer);
- before the worker halts (shutdown, a hand-off of running sequences) or reports an error for a request,
  it takes what is held (`take_all`, `take`): the gateway then holds every token the engine produced.

`interval_s` = 0: every event goes out in the step that produced it, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.protocol import OutputBatch, TokenEvent


@dataclass(slots=True)
class _Held:
    gateway_id: str
    since: float
    event: TokenEvent


def merge(first: TokenEvent, second: TokenEvent) -> TokenEvent:
    """One event for two consecutive events of the same request attempt."""
    if (first.request_id, first.attempt) != (second.request_id, second.attempt):
        raise ValueError(f"second: request {second.request_id!r} attempt {second.attempt} is another stream")
    if second.index != first.index + len(first.token_ids):
        raise ValueError(f"second.index: {second.index}, expected {first.index + len(first.token_ids)}")
    logprobs = None
    if first.logprobs is not None or second.logprobs is not None:
        logprobs = [*(first.logprobs or ()), *(second.logprobs or ())]
    return TokenEvent(
        request_id=first.request_id,
        index=first.index,
        token_ids=[*first.token_ids, *second.token_ids],
        text=first.text + second.text,
        logprobs=logprobs,
        finish_reason=second.finish_reason,
        num_prompt_tokens=second.num_prompt_tokens or first.num_prompt_tokens,
        attempt=first.attempt,
    )


class StreamCoalescer:
    def __init__(self, interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s: {interval_s} must be >= 0")
        self.interval_s = interval_s
        self._held: dict[tuple[str, int], _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, batches: dict[str, OutputBatch], now: float, worker_id: str) -> dict[str, OutputBatch]:
        """One step's events (per gateway) in; -> what goes out now (per gateway): the due ones of this
        step and any earlier held event that has waited `interval_s`."""
        out: dict[str, OutputBatch] = {}
        for gateway_id, batch in batches.items():
            for event in batch.tokens:
                key = (event.request_id, event.attempt)
                held = self._held.pop(key, None)
                if held is not None:
                    event = merge(held.event, event)
                since = held.since if held is not None else now
                if event.index == 0 or event.finish_reason is not None or now - since >= self.interval_s:
                    _put(out, gateway_id, worker_id, event)
                else:
                    self._held[key] = _Held(gateway_id, since, event)
            for error in batch.errors:
                _batch(out, gateway_id, worker_id).errors.append(error)
        self._take_due(now, out, worker_id)
        return out

    def due(self, now: float, worker_id: str) -> dict[str, OutputBatch]:
        """What has waited `interval_s` (the worker's timer)."""
        out: dict[str, OutputBatch] = {}
        self._take_due(now, out, worker_id)
        return out

    def next_due(self) -> float | None:
        """When the oldest held event is due (the clock of `add`), None if nothing is held."""
        if not self._held:
            return None
        return min(h.since for h in self._held.values()) + self.interval_s

    def take(self, request_id: str, worker_id: str) -> dict[str, OutputBatch]:
        """What is held of `request_id` (any attempt), now."""
        out: dict[str, OutputBatch] = {}
        for key in [k for k in self._held if k[0] == request_id]:
            held = self._held.pop(key)
            _put(out, held.gateway_id, worker_id, held.event)
        return out

    def take_all(self, worker_id: str) -> dict[str, OutputBatch]:
        out: dict[str, OutputBatch] = {}
        for held in self._held.values():
            _put(out, held.gateway_id, worker_id, held.event)
        self._held.clear()
        return out

    def _take_due(self, now: float, out: dict[str, OutputBatch], worker_id: str) -> None:
        for key in [k for k, h in self._held.items() if now - h.since >= self.interval_s]:
            held = self._held.pop(key)
            _put(out, held.gateway_id, worker_id, held.event)


def _batch(out: dict[str, OutputBatch], gateway_id: str, worker_id: str) -> OutputBatch:
    batch = out.get(gateway_id)
    if batch is None:
        batch = out[gateway_id] = OutputBatch(worker_id=worker_id)
    return batch


def _put(out: dict[str, OutputBatch], gateway_id: str, worker_id: str, event: TokenEvent) -> None:
    _batch(out, gateway_id, worker_id).tokens.append(event)

"""The request ledger: what a worker holds and what each event means for it. Pure: no NATS, Redis
or torch.

For every request the worker holds it keeps the attempt held, the pulled message still to settle
(an opaque handle: acked when the work is done or handed on, nak'd to give it back) and whether
the request is in the engine. Events come from the bus (a pulled message, a cancel), the engine
(an addition done, a sequence finished or taken out) and the worker itself (a hand-off done,
shutdown); each returns the `Effects` the worker carries out: sequences to abort in the engine,
messages to ack or nak.

The engine is modelled as it will be once every call queued on its thread has run (one thread
runs them in order): an addition counts from the moment it is queued (`adding`). So a cancel or a
newer attempt that arrives while an addition waits its turn queues its abort behind that addition,
and no sequence stays in the engine that the worker no longer holds (its blocks never freed, a
newer attempt refused as 'already in the engine'). In the engine each attempt has its own id
(`engine_id`), so an output or abort of an attempt replaced meanwhile is never taken for the
current attempt's.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ferry.protocol import GenerateRequest
from ferry_services.worker.recent import RecentIds

Handle = Any
"""A pulled message (`ferry.bus.WorkItem` in the worker); the ledger only hands it back."""


def engine_id(request: GenerateRequest) -> str:
    """The id of one attempt's sequence in the engine."""
    return f"{request.request_id}@{request.attempt}"


class Admit(enum.Enum):
    """What a pulled message is to this worker."""

    NEW = "new"
    """Hold it and admit it (an older attempt held here was replaced: see the effects)."""
    REDELIVERY = "redelivery"
    """The attempt held here, delivered again: nothing to do, the held copy is settled later."""
    STALE = "stale"
    """Older than the attempt held here (the gateway migrated away from it): acked, dropped."""
    CANCELLED = "cancelled"
    """Cancelled for every attempt: acked, dropped."""
    GIVEN_BACK = "given_back"
    """This worker is draining: nak'd, so it goes to another worker."""


@dataclass(slots=True)
class Effects:
    """What the worker must do: abort sequences in the engine first, then settle messages."""

    abort: list[str] = field(default_factory=list)
    """Engine ids to abort (queued on the engine thread now, so behind any addition)."""
    ack: list[Handle] = field(default_factory=list)
    nak: list[tuple[Handle, float | None]] = field(default_factory=list)
    """(message, redelivery delay in seconds or None for at once)."""

    def __bool__(self) -> bool:
        return bool(self.abort or self.ack or self.nak)

    def __iadd__(self, other: Effects) -> Effects:
        self.abort += other.abort
        self.ack += other.ack
        self.nak += other.nak
        return self


@dataclass(slots=True)
class Admission:
    decision: Admit
    effects: Effects


@dataclass(slots=True)
class Held:
    request: GenerateRequest
    """The attempt held: the very object admitted (a redelivered copy is another object)."""
    handle: Handle | None
    """The message still to settle; None once settled (a decode worker acks on joining)."""
    in_engine: bool = False
    """Queued for or in the engine: dropping it means aborting it there."""


class RequestLedger:
    def __init__(self, cancelled_capacity: int = 10_000) -> None:
        self._held: dict[str, Held] = {}
        self.cancelled = RecentIds(cancelled_capacity)
        """Requests cancelled for every attempt: a message for one that arrives later is dropped."""
        self.draining = False
        """Shutting down: pulled messages are given back."""

    # ---- queries -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def request(self, request_id: str) -> GenerateRequest | None:
        held = self._held.get(request_id)
        return held.request if held is not None else None

    def requests(self) -> Iterator[GenerateRequest]:
        return (held.request for held in self._held.values())

    def handles(self) -> list[Handle]:
        """Messages not settled yet (their leases must be kept alive)."""
        return [held.handle for held in self._held.values() if held.handle is not None]

    def owner(self, engine_id: str) -> GenerateRequest | None:
        """The held request whose attempt has this engine id; None when that attempt is not held."""
        request_id, _, attempt = engine_id.rpartition("@")
        held = self._held.get(request_id)
        return held.request if held is not None and str(held.request.attempt) == attempt else None

    def is_current(self, request: GenerateRequest) -> bool:
        """Still held as this very attempt: not cancelled, replaced or given back meanwhile."""
        held = self._held.get(request.request_id)
        return held is not None and held.request is request

    # ---- the bus -----------------------------------------------------------------------------
    def pulled(self, request: GenerateRequest, handle: Handle) -> Admission:
        """Decide what a pulled message is; a NEW one is held from now on."""
        request_id, effects = request.request_id, Effects()
        held = self._held.get(request_id)
        if request_id in self.cancelled:
            return Admission(Admit.CANCELLED, Effects(ack=[handle]))
        if held is not None and request.attempt < held.request.attempt:
            return Admission(Admit.STALE, Effects(ack=[handle]))
        if held is not None and request.attempt == held.request.attempt:
            return Admission(Admit.REDELIVERY, effects)
        if self.draining:
            return Admission(Admit.GIVEN_BACK, Effects(nak=[(handle, None)]))
        if held is not None:  # a newer attempt: the gateway migrated the request, the copy here goes
            effects += self._drop(request_id)
        self._held[request_id] = Held(request, handle)
        return Admission(Admit.NEW, effects)

    def cancel(self, request_ids: Iterable[str], below_attempt: int | None = None) -> Effects:
        """`Cancel`: every attempt (remembered, so a later message is dropped too), or with
        `below_attempt` only older attempts: the current attempt of a migrated request may be here."""
        effects = Effects()
        for request_id in request_ids:
            if below_attempt is None:
                self.cancelled.add(request_id)
            held = self._held.get(request_id)
            if held is None or (below_attempt is not None and held.request.attempt >= below_attempt):
                continue
            effects += self._drop(request_id)
        return effects

    # ---- the engine --------------------------------------------------------------------------
    def adding(self, request: GenerateRequest) -> bool:
        """About to queue `request`'s engine addition: False (do not add) when it is no longer held."""
        if not self.is_current(request):
            return False
        self._held[request.request_id].in_engine = True
        return True

    def added(self, request: GenerateRequest, joined: bool, ack: bool) -> Effects:
        """The addition ran: `joined` (in the engine now) or refused (no room). With `ack`, a joined
        request's message is settled now. Gone meanwhile: its abort was queued behind the addition."""
        held = self._held.get(request.request_id)
        if held is None or held.request is not request:
            return Effects()
        held.in_engine = joined
        if not (joined and ack and held.handle is not None):
            return Effects()
        handle, held.handle = held.handle, None
        return Effects(ack=[handle])

    def left_engine(self, request: GenerateRequest) -> None:
        """Taken out of the engine (its KV copied out for a hand-off); still held."""
        if self.is_current(request):
            self._held[request.request_id].in_engine = False

    def finished(self, engine_id: str) -> Effects:
        """The engine finished this attempt (and freed it): done here."""
        request = self.owner(engine_id)
        if request is None:
            return Effects()
        held = self._held.pop(request.request_id)
        return Effects(ack=[held.handle]) if held.handle is not None else Effects()

    # ---- the worker --------------------------------------------------------------------------
    def done(self, request: GenerateRequest) -> Effects:
        """Handed on, or refused for good (an error went to the client): ack, unless gone meanwhile.
        Never in the engine at this point."""
        if not self.is_current(request):
            return Effects()
        held = self._held.pop(request.request_id)
        assert not held.in_engine, f"{request.request_id} is done but still in the engine"
        return Effects(ack=[held.handle]) if held.handle is not None else Effects()

    def release_all(self) -> list[Held]:
        """Shutdown: the ledger lets go of everything; the worker moves or gives back each one."""
        released = list(self._held.values())
        self._held.clear()
        return released

    def _drop(self, request_id: str) -> Effects:
        """Stop holding a request for good: abort it in the engine, ack its message."""
        held = self._held.pop(request_id)
        effects = Effects(abort=[engine_id(held.request)] if held.in_engine else [])
        if held.handle is not None:
            effects.ack.append(held.handle)
        return effects

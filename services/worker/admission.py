"""How pulled work joins the engine: every message a worker pulls, of either role, enters through
`accept` (the ledger decides it: new, a duplicate, a replaced attempt), is admitted (`admit`: fetch
what KV there is, the role says where from, then `joining.join` on the engine thread) and what the
ledger decided is carried out (`apply`: aborts on the engine thread, acks and naks on JetStream).
Part of `Worker` (base.py).

`accept` never waits for the engine thread: the pull loop takes the next message while the step in
flight runs (a prefill step can take 100s of ms), so a message that arrives meanwhile has its KV
fetched and its addition queued before that step ends, and joins the next step instead of the one
after it (issue #21: the pull waited behind the previous message's addition, up to a whole step).
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from ferry.bus import WorkItem, trace
from ferry.protocol import GenerateRequest
from ferry_services.worker.compute import ComputeThread
from ferry_services.worker.joining import FetchedKV, Joined, join
from ferry_services.worker.ledger import Admit, Effects, RequestLedger
from ferry_services.worker.slo import WorkerSlo
from ferry_services.worker.window import AdmissionWindow

log = logging.getLogger(__name__)

ROOM_WAIT_S = 0.5
"""A hand-off refused for want of room (its KV is its own: it cannot be recomputed for free) tries again after
each engine step, or after this long at the latest."""


class _Fetch:
    """`Admission.admit`'s default: fetch the KV there."""


class Admission(abc.ABC):
    """Mixed into `Worker`, which provides these:"""

    role: str
    admits_in_pull_order: bool
    kv_is_optional: bool
    acks_on_join: bool
    engine: Any
    compute: ComputeThread
    ledger: RequestLedger
    slo: WorkerSlo
    num_adding: int
    has_work: asyncio.Event
    window: AdmissionWindow
    arrivals: asyncio.Event
    has_room: asyncio.Event
    room_freed: asyncio.Event
    settings: Any
    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    publish_error: Callable[[GenerateRequest, str, str, bool], Awaitable[None]]

    num_joining_tokens: int = 0
    """In-order roles: prompt tokens pulled whose addition has not run on the engine thread yet, less
    the blocks the balancer hinted cached; the engine's own count (`num_queued_prefill_tokens`) takes
    them over once added. The pull budget counts them (prefill.py), as the pull no longer waits for them."""
    _last_batch_queued: asyncio.Future | None = None
    """In-order roles: set once the last accepted batch's additions are queued; the next batch's wait for it."""

    async def accept(self, items: list[WorkItem]) -> None:
        """Every pulled message enters here, a fetched batch at a time: the ledger decides each in
        pull order, then the new ones are admitted, without waiting for the engine (module docstring).
        In-order roles (prefill) fetch a batch's KV side by side, then queue its additions on the
        engine thread together and after the previous batch's: a burst's prompts are prefilled
        together, in steps of up to max_batch_tokens, in the order pulled, not one step per prompt."""
        works = [item.msg for item in items if await self._is_new(item)]
        last = items[-1] if items else None
        self.window.pulled(
            [work.request.request_id for work in works],
            last.num_pending if last else 0,
            getattr(last.msg, "num_routing_behind", 0) if last else 0,  # PrefillWork only (window.py)
        )
        self.arrivals.set()
        if not self.admits_in_pull_order:
            for work in works:
                self.spawn(self.admit(work))
            return
        if not works:
            return
        fetches = [asyncio.ensure_future(self.fetch_kv(work)) for work in works]  # started now, off this loop
        after, self._last_batch_queued = self._last_batch_queued, asyncio.get_running_loop().create_future()
        self.spawn(self._admit_in_pull_order(works, fetches, after, self._last_batch_queued))

    async def _admit_in_pull_order(
        self, works: list[Any], fetches: Sequence[asyncio.Future], after: asyncio.Future | None, queued: asyncio.Future
    ) -> None:
        """`accept`'s in-order admissions of one batch, spawned: its KV, then its additions queued behind
        the previous batch's (`after`), then `queued` set; then the additions' outcomes."""
        joining = [self._joining_tokens(work) for work in works]
        self.num_joining_tokens += sum(joining)
        admissions: list[asyncio.Future] = []
        try:
            kvs = await asyncio.gather(*fetches)
            if after is not None:
                await asyncio.wait([after])
            # tasks start in the order created, and each queues its addition before it first waits;
            # `queued` wakes the next batch only after them (asyncio runs ready callbacks first in, first out)
            for work, kv, num_tokens in zip(works, kvs, joining):
                admission = asyncio.ensure_future(self.admit(work, kv))
                admission.add_done_callback(functools.partial(self._joined_tokens, num_tokens))
                admissions.append(admission)
        finally:
            queued.set_result(None)
            if not admissions:  # its KV fetch failed (or this task was cancelled): none will be added
                self._joined_tokens(sum(joining))
                for work in works:  # none is left counted as on its way (window.py)
                    self._no_longer_arriving(work.request)
        await asyncio.gather(*admissions)

    def _joining_tokens(self, work: Any) -> int:
        """Tokens `work` will add to the engine's prefill queue, as far as known before its KV is fetched."""
        return max(0, len(work.request.all_token_ids) - work.num_cached_blocks_hint * self.settings.block_size)

    def _joined_tokens(self, num_tokens: int, _: object = None) -> None:
        """`num_tokens` joined the engine or will not (also an admission's done callback: `_` is its future)."""
        self.num_joining_tokens -= num_tokens
        self.has_room.set()  # a pull loop that found the budget spent looks again

    async def _is_new(self, item: WorkItem) -> bool:
        request = item.msg.request
        trace.hop(request.request_id, f"{self.role[0]}w.pulled", pending=item.num_pending)
        self.slo.on_pulled(request)
        admission = self.ledger.pulled(request, item)
        await self.apply(admission.effects)
        return admission.decision is Admit.NEW

    async def admit(self, work: Any, kv: FetchedKV | type[_Fetch] | None = _Fetch) -> None:
        """Fetch what KV there is unless given (the running batch keeps stepping meanwhile), then join the engine."""
        try:
            await self._admit(work, kv)
        finally:
            self._no_longer_arriving(work.request)

    async def _admit(self, work: Any, kv: FetchedKV | type[_Fetch] | None) -> None:
        request: GenerateRequest = work.request
        if kv is _Fetch:
            kv = await self.fetch_kv(work)
        try:
            joined = await self.add_to_engine(request, join, self.engine, request, kv, self.kv_is_optional)
            while joined is Joined.NO_ROOM:  # the balancer's view was stale, or a burst outgrew the pool: wait here
                self.ledger.added(request, joined=False, ack=False)
                await self._wait_for_room()
                joined = await self.add_to_engine(request, join, self.engine, request, kv, self.kv_is_optional)
        except ValueError as exc:  # does not fit this engine: the client's fault, not retryable
            self.ledger.added(request, joined=False, ack=False)
            if self.ledger.is_current(request):
                await self.publish_error(request, "bad_request", str(exc), False)
            await self.apply(self.ledger.done(request))
            return
        if joined is None:
            return  # cancelled, replaced or given back before it was added
        await self.apply(self.ledger.added(request, joined=True, ack=self.acks_on_join))
        self.count_join(request, joined, kv)
        self.has_work.set()

    async def _wait_for_room(self) -> None:
        """Until the next engine step ends (sequences may have finished and freed blocks), ROOM_WAIT_S at most.
        The message stays held meanwhile (its lease extended with the others'): it is never nak'd for room,
        because every redelivery spends one of JetStream's max_deliver, and a hand-off that waited through
        them all was dropped for good (issue #21's restart bench: 12 sequences of ~1.5k tokens arriving at
        once at a decode worker with a 16k-token pool lost one; the gateway gave up on it after 120 s)."""
        self.room_freed.clear()
        try:
            await asyncio.wait_for(self.room_freed.wait(), ROOM_WAIT_S)
        except asyncio.TimeoutError:
            pass

    @abc.abstractmethod
    async def fetch_kv(self, work: Any) -> FetchedKV | None:
        """KV for the leading tokens of `work`'s request, from the store; None to compute them."""

    def count_join(self, request: GenerateRequest, joined: Joined, kv: FetchedKV | None) -> None:  # noqa: B027 (a hook)
        """The role's counters of how sequences joined."""

    async def add_to_engine(self, request: GenerateRequest, fn, *args) -> Any:
        """Run an engine addition (`joining.join`) with the next step queued right behind it on the engine
        thread, instead of after a trip back to this loop: one thread hop less before a new request's
        first token. None, without adding, when `request` is no longer held. Raises what `fn` raises."""
        if not self.ledger.adding(request):
            return None
        self.num_adding += 1
        added = self.compute.submit(fn, *args)
        self._no_longer_arriving(request)  # a step queued from now on runs behind the addition
        self.has_work.set()
        try:
            return await added
        finally:
            self.num_adding -= 1

    def _no_longer_arriving(self, request: GenerateRequest) -> None:
        """Its addition is queued on the engine thread, or it will not be added: the admission window
        (window.py) waits for it no more. Wakes the engine loop if it holds a step."""
        self.window.queued(request.request_id)
        self.arrivals.set()

    async def apply(self, effects: Effects) -> None:
        """Carry out what the ledger decided. Aborts are queued on the engine thread at once (before
        this coroutine first yields), so they run behind every addition already queued."""
        if not effects:
            return
        aborted = self.compute.submit(self._abort, effects.abort) if effects.abort else None
        for handle in effects.ack:
            await _settle(handle.ack())
        for handle, delay_s in effects.nak:
            await _settle(handle.nak(delay_s))
        if aborted is not None:
            await aborted

    def _abort(self, sequence_ids: list[str]) -> None:
        for sequence_id in sequence_ids:
            self.engine.abort_request(sequence_id)


async def _settle(call) -> None:
    """Ack or nak one message; a failure (connection closing) is safe: JetStream redelivers it."""
    try:
        await call
    except Exception:
        log.warning("could not settle a work message", exc_info=True)

"""The decode worker: prefilled sequences in, one token per engine step out, batched per gateway.

Pulls `Handoff`s from `ferry.work.decode.<id>` while it has room under its batch cap; each one's
KV blocks are fetched from the store (`KvStore.get_blocks`) on the asyncio thread while the
running batch keeps stepping on the engine thread, then loaded into the pool and joined to the
batch (`engine.add_prefilled`). The message is acked once the sequence is in the engine. Blocks
that are missing (evicted, Redis down, another model) are recomputed from the tokens instead:
counted in `num_recomputed` and logged, never silent.

Scale-down (SIGTERM): it stops pulling and reports itself draining (no balancer routes to it), lets
its sequences finish within FERRY_SHUTDOWN_GRACE_S, then hands each unfinished one on like a
prefill worker does: its KV and tokens so far to the store, a `Handoff` through the decode-balancer
to another decode worker, which continues at the next token. One that nobody takes gets an
`ErrorEvent(worker_lost, retryable)`, so the gateway migrates it. Hand-offs pulled but not joined
yet go back to the queue (nak); the balancers move this worker's queue once it is gone.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from ferry.kvstore import KvStoreError
from ferry.protocol import GenerateRequest, Handoff
from ferry_services.worker.base import Worker
from ferry_services.worker.joining import FetchedKV, Joined
from ferry_services.worker.ledger import Effects, Held, engine_id
from ferry_services.worker.writeback import write_back

log = logging.getLogger(__name__)

MOVE_TIMEOUT_S = 5.0
"""At shutdown, how long a sequence is offered to the decode-balancers before it is left to the
gateway's migration: a worker exits within FERRY_SHUTDOWN_GRACE_S + this (+ one store write)."""


class DecodeWorker(Worker):
    role = "decode"
    work_type = Handoff
    pipelined = True
    kv_is_optional = False
    admits_in_pull_order = False
    acks_on_join = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_transferred = 0
        """Sequences whose KV came from the store."""
        self.num_recomputed = 0
        """Sequences whose KV was missing and had to be recomputed."""
        self.num_moved = 0
        """Sequences handed on to another decode worker at shutdown."""
        self.num_written_back_blocks = 0
        """Output blocks of finished sequences written to the store (FERRY_KV_WRITEBACK)."""
        if self.settings.kv_writeback:
            self.start_write_back()

    async def after_step(self, outputs: list) -> None:
        if not self.settings.kv_writeback:
            return await super().after_step(outputs)
        finished = [(o.request_id, self.ledger.owner(o.request_id)) for o in outputs if o.finish_reason is not None]
        await super().after_step(outputs)  # tokens out first
        for sequence_id, request in finished:
            if request is not None:
                self.queue_write_back(functools.partial(self.write_back, sequence_id, request))

    async def write_back(self, sequence_id: str, request: GenerateRequest) -> None:
        """The full blocks a finished sequence added after its prompt (the prefill worker stored the
        prompt's) to the store, and its chain to the prefill-balancers (writeback.py)."""
        self.num_written_back_blocks += await write_back(self, sequence_id, request, skip_prompt=True)

    async def fetch_kv(self, handoff: Handoff) -> FetchedKV | None:
        data = await self.load_blocks(handoff)
        return FetchedKV(data, handoff.num_kv_tokens) if data is not None else None

    async def load_blocks(self, handoff: Handoff):
        """[n, *block_shape] KV of the hand-off, or None when it cannot be used."""
        if handoff.num_kv_tokens == 0:
            return None
        if handoff.kv_namespace != self.namespace:
            log.warning(
                "KV of %s is from model %s, this worker runs %s",
                handoff.request.request_id,
                handoff.kv_namespace,
                self.namespace,
            )
            return None
        try:
            return await self.store.get_blocks([b.block_hash for b in handoff.kv_blocks])
        except KvStoreError as exc:
            log.warning("KV store failed for %s: %s", handoff.request.request_id, exc)
            return None

    def count_join(self, request: GenerateRequest, joined: Joined, kv: FetchedKV | None) -> None:
        if joined is Joined.WITH_KV:
            self.num_transferred += 1
        else:
            self.num_recomputed += 1
            log.warning(
                "KV of %s not in the store: recomputing it (%d tokens)", request.request_id, len(request.all_token_ids)
            )

    # ---- scale-down --------------------------------------------------------------------------
    async def release(self, held: list[Held]) -> None:
        """Hand on every sequence still running; give back what has not joined yet."""
        taken = await self.compute.call(self._take_running, [engine_id(h.request) for h in held if h.in_engine])
        moving = [h for h in held if engine_id(h.request) in taken]
        staying = [h for h in held if engine_id(h.request) not in taken]
        await self.apply(Effects(nak=[(h.handle, None) for h in staying if h.handle is not None]))
        for h in staying:
            if h.handle is None:  # acked, yet not in the engine (a halt that timed out): let the gateway redo it
                await self.publish_error(h.request, "worker_lost", f"{self.worker_id} shut down", retryable=True)
        moved = await asyncio.gather(*(self.move(h, *taken[engine_id(h.request)]) for h in moving))
        self.num_moved += sum(moved)
        log.info(
            "shutdown: %d sequences handed on, %d left to the gateway to migrate, %d given back to the queue",
            sum(moved),
            len(moved) - sum(moved),
            len(staying),
        )

    def _take_running(self, sequence_ids: list[str]) -> dict[str, tuple]:
        """Runs on the engine thread: (KV, output tokens so far) of each sequence, taken out."""
        taken = {}
        for sequence_id in sequence_ids:
            try:
                taken[sequence_id] = self.engine.take_running(sequence_id)
            except KeyError:  # its addition was refused, or it finished
                continue
        return taken

    async def move(self, held: Held, kv, output_token_ids: list[int]) -> bool:
        """Offer one unfinished sequence to another decode worker; else have the gateway migrate it."""
        request = held.request
        new_token_ids = output_token_ids[len(request.output_token_ids) :]
        accepted = not await self.handoffs.send(request, new_token_ids, kv, MOVE_TIMEOUT_S)
        if not accepted:
            message = f"decode worker {self.worker_id} shut down and no other took the sequence"
            await self.publish_error(request, "worker_lost", message, retryable=True)
        await self.apply(Effects(ack=[held.handle] if held.handle is not None else []))
        return accepted

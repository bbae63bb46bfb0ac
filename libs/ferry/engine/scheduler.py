"""Iteration-level scheduler: which sequences run in the next step and how many tokens each.

Every step first gives each running decode its one token, then fills the rest of the token
budget with prefill chunks (a long prompt spreads over several steps), oldest first. New
sequences are admitted first-come-first-served while blocks, the running-sequence cap and the
budget allow; with shortest_first, shortest prompt first, except that a sequence an admission has
already passed over once goes before every newer one (in arrival order), so none waits more than one
extra admission. With split_min_tokens (shortest_first), an admission that finds only fresh prompts
waiting takes the shortest of them up to half of their tokens (at least split_min_tokens, at most the
budget), not a whole budget: a burst that fits one or two steps gets most of its first tokens out in a
step about half as long, and what it passed over goes whole in the next step (issue #22: SmolLM2's
24-request burst is ~2.6k prompt tokens; its shortest 17 are half of them). When the pool runs dry
the newest running sequence is preempted (its blocks are freed, it goes back to the front of the
queue and is recomputed later), so the oldest always progresses and nobody starves. Static mode
admits a new batch only when the running one is done, and only as many members as the pool holds at
their full length (prompt + max_tokens): the baseline that dynamic batching is measured against. No
torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ferry.engine.block_manager import BlockManager
from ferry.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    """Tokens each sequence computes this step (1 for a decode, a chunk for a prefill)."""
    num_preempted: int = 0

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        static_batching: bool = False,
        shortest_first: bool = False,
        split_min_tokens: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.static_batching = static_batching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.shortest_first = shortest_first
        self.split_min_tokens = split_min_tokens
        """shortest_first: an admission of fresh prompts only stops at half their tokens, not below this; 0 = off."""
        self._passed_over: set[str] = set()
        """request ids of waiting sequences that an admission (shortest_first) left waiting: they go first next."""

    # ---- queue -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence that already holds its blocks (KV written from outside)."""
        assert seq.block_ids, "add_running needs a sequence with blocks"
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (finished, aborted or handed off) and free its blocks now."""
        self.detach(seq)
        self.block_manager.free(seq)

    def detach(self, seq: Sequence) -> None:
        """Take `seq` out of the queues but keep its blocks (prefill role pins them)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def reorder_waiting(self, request_ids: list[str]) -> None:
        """The waiting queue in this order (by request id); the ones not listed follow in their order."""
        rank = {rid: i for i, rid in enumerate(request_ids)}
        self.waiting = deque(sorted(self.waiting, key=lambda s: rank.get(s.request_id, len(rank))))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_queued_prefill_tokens(self) -> int:
        queued = sum(s.num_uncomputed_tokens for s in self.waiting)
        return queued + sum(s.num_uncomputed_tokens - 1 for s in self.running if not s.is_prefill_done)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        budget -= self._schedule_decodes(batch)
        if self.static_batching:
            if not self.running:
                self._admit(batch, budget=None)
            self._schedule_prefills(batch, budget)
        else:
            budget -= self._schedule_prefills(batch, budget)
            if batch.num_preempted == 0:
                self._admit(batch, budget)
        return batch

    def update(self, batch: ScheduledBatch) -> None:
        """The step ran: its tokens' KV is in the cache now."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.block_manager.commit(seq)

    # ---- internals -------------------------------------------------------------------------
    def _schedule_decodes(self, batch: ScheduledBatch) -> int:
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or not seq.is_prefill_done:
                continue  # preempted earlier in this loop, or still prefilling
            if self._make_room(seq, batch):
                batch.add(seq, 1)
        return len(batch.seqs)

    def _make_room(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Find a slot for one more token of `seq`, preempting the newest sequences if needed."""
        while not self.block_manager.append_slots(seq, 1):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, batch: ScheduledBatch, budget: int) -> int:
        used = 0
        for seq in self.running:
            if seq.is_prefill_done or used >= budget:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget - used)
            if not self.block_manager.append_slots(seq, num_new):
                break  # only sequences joined from outside lack blocks here; retry next step
            batch.add(seq, num_new)
            used += num_new
        return used

    def _admit(self, batch: ScheduledBatch, budget: int | None) -> None:
        """Admit waiting sequences in order; with a budget, schedule their first chunk too.

        Static mode reserves each member's whole future (prompt + max_tokens) up front, as a static
        server must: it cannot preempt, so a batch it admits always runs to completion."""
        bm, used = self.block_manager, 0
        reserved = sum(self._growth_blocks(s, len(s.block_ids)) for s in self.running) if self.static_batching else 0
        order = self._admission_order() if self.shortest_first and budget is not None else list(self.waiting)
        split = self._split_tokens(order) if budget is not None else None
        for seq in order:
            if len(self.running) >= self.max_num_seqs or (budget is not None and used >= budget):
                break
            if split is not None and used and used + seq.num_uncomputed_tokens > split:
                break  # the rest of a split admission goes whole in the next step
            match = bm.match_prefix(seq)
            if match.is_pending:
                continue  # its prefix is being computed this very step: reuse it next step
            growth = self._growth_blocks(seq, bm.blocks_for(seq.num_tokens)) if self.static_batching else 0
            if bm.num_blocks_taken(seq, match) + growth + reserved > bm.num_free_blocks:
                break  # nobody overtakes a sequence that does not fit
            allocated = bm.allocate(seq, match)
            assert allocated, "num_blocks_taken said it fits"
            reserved += growth
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if budget is not None:
                num_new = min(seq.num_uncomputed_tokens, budget - used)
                batch.add(seq, num_new)
                used += num_new
        if self.shortest_first and budget is not None:
            self._passed_over = {s.request_id for s in self.waiting if s.request_id in self._passed_over or used}

    def _split_tokens(self, order: list[Sequence]) -> int | None:
        """Where a split admission stops (module docstring): half the fresh prompts' tokens, at least
        split_min_tokens; None (fill the budget) when off, or when a passed-over or preempted prompt waits."""
        if not (self.shortest_first and self.split_min_tokens) or any(
            s.request_id in self._passed_over or s.num_preemptions for s in order
        ):
            return None
        return max(self.split_min_tokens, -(-sum(s.num_uncomputed_tokens for s in order) // 2))

    def _admission_order(self) -> list[Sequence]:
        """shortest_first: the sequences passed over before, in arrival order, then the rest shortest prompt first."""
        overdue = [s for s in self.waiting if s.request_id in self._passed_over or s.num_preemptions]
        fresh = [s for s in self.waiting if s.request_id not in self._passed_over and not s.num_preemptions]
        return overdue + sorted(fresh, key=lambda s: s.num_uncomputed_tokens)

    def _growth_blocks(self, seq: Sequence, num_held: int) -> int:
        """Blocks `seq` may still append, holding num_held, before it reaches its token limit."""
        return max(0, self.block_manager.blocks_for(seq.num_tokens_limit) - num_held)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        batch.num_preempted += 1
        self.num_preemptions += 1
        if seq in batch.seqs:  # already given a token this step: take it back
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]

"""SloHooks: what an SLO controller reads of an engine and sets on it (a mixin of LLMEngine: it uses
its scheduler). Reads: the prefill backlog, the decode load, the prompts waiting or mid-prefill and the
decoding sequences, each as plain tuples. Sets: the running-sequence cap, the step's token budget and
the waiting queue's admission order, each from the next step on. ferry.slo decides; this only applies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.engine.sequence import Sequence

if TYPE_CHECKING:
    from ferry.engine.scheduler import Scheduler


class SloHooks:
    scheduler: Scheduler

    def set_limits(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Change the running-sequence cap and the step's token budget from the next step on (an
        SLO controller's decisions; config keeps the values the engine started with). A cap below
        the number running admits nobody until enough finish: nothing is preempted for it."""
        if max_num_seqs is not None:
            if max_num_seqs < 1:
                raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1")
            self.scheduler.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is not None:
            if max_num_batched_tokens < 1:
                raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}: must be >= 1")
            self.scheduler.max_num_batched_tokens = max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        """The running-sequence cap in force now (config's, unless set_limits changed it)."""
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    def prefill_backlog(self) -> list[tuple[float, int]]:
        """(arrival_time, tokens still to prefill) of every sequence not prefilled yet, in the order
        the scheduler will take them: running ones mid-prefill, then the waiting queue."""
        running = [s for s in self.scheduler.running if not s.is_prefill_done]
        return [(s.arrival_time, s.num_uncomputed_tokens) for s in (*running, *self.scheduler.waiting)]

    def decode_load(self) -> tuple[int, int]:
        """(sequences that decode next step, context tokens they hold): what a chunk budget must
        leave room for."""
        decoding = [s for s in self.scheduler.running if s.is_prefill_done]
        return len(decoding), sum(s.num_computed_tokens for s in decoding)

    def prompts(self, waiting: bool = True) -> list[tuple[str, float, int, int]]:
        """(request id, arrival_time, tokens still to prefill, output tokens still allowed) of the
        waiting queue in admission order (waiting=True) or of the running sequences still
        prefilling: what an SLO controller plans admission with."""
        seqs = self.scheduler.waiting if waiting else [s for s in self.scheduler.running if not s.is_prefill_done]
        return [(s.request_id, s.arrival_time, s.num_uncomputed_tokens, _left(s)) for s in seqs]

    def running_decodes(self) -> list[tuple[str, int, int, int]]:
        """(request id, prompt tokens, output tokens so far, output tokens still allowed) of the
        sequences that decode next step."""
        running = self.scheduler.running
        return [
            (s.request_id, s.num_prompt_tokens, s.num_output_tokens, _left(s)) for s in running if s.is_prefill_done
        ]

    def reorder_waiting(self, request_ids: list[str]) -> None:
        """Admit the waiting sequences in this order from the next step on (an SLO controller's
        decision); waiting ones not listed keep their order behind the listed."""
        self.scheduler.reorder_waiting(request_ids)


def _left(seq: Sequence) -> int:
    return max(0, seq.num_tokens_limit - seq.num_tokens)

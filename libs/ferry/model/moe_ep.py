"""Expert-parallel DeepSeek-V3 MoE: this rank holds some routed experts, every rank the router and
the shared experts. Tokens go to the ranks holding their experts and come back by all-to-all.

One layer's communication: the dispatch sends each token to the ranks holding its experts, the
combine brings the experts' outputs back to where the token lives (all_to_all_single, async_op=True).
A receiver must know how many rows come before it can post the dispatch: given every rank's token
count of this micro-batch (one small all-gather per step, by the runner), a small dispatch pads
each block to a bound both sides know and carries the counts in a header row, one collective;
otherwise the per-slot counts go first, then exactly the rows (two). `steps` is a generator that
yields right after each launch, so a driver can run another micro-batch's compute before it waits;
what needs no other rank fills the windows no other micro-batch's big compute covers: the exact
rows' (this rank's experts on its own rows) and the combine's (shared experts). `forward` just runs
it through.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ferry.kernels import silu_and_mul
from ferry.model import ep_layout
from ferry.model.grouped_experts import GroupedExperts
from ferry.model.moe import MoE, Router
from ferry.parallel.placement import ExpertPlacement

Steps = Generator[None, None, torch.Tensor]
Exchange = Generator[
    None, None, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
]
"""A dispatch: yields at its launches; -> (counts received [n, S], rows received, where each
source's block of rows starts, the shared experts' output if it computed them, this rank's experts'
output on the rows it sent itself if it computed them, in the order sent)."""

PADDED_EXCHANGE_MAX_BYTES = 1 << 20
"""Largest padded dispatch (all blocks, one rank's view) sent as one all-to-all with its counts."""


def run_to_end(steps: Generator[None, None, Any]) -> Any:
    """Drives a steps generator without interleaving anything: each launch is waited on at once."""
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe: MoE, placement: ExpertPlacement, rank: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.gate: Router = moe.gate
        self.shared_experts = moe.shared_experts
        self.rank, self.group = rank, group
        self.experts = nn.ModuleList()
        self.comm_wait_s = 0.0
        """Seconds this layer spent blocked in wait() on its all-to-alls."""
        self.comm_wait_by_kind: dict[str, float] = {}
        """The same seconds by collective: counts, dispatch (rows, or padded rows + header), combine."""
        self.expert_tokens = torch.zeros(placement.num_experts, dtype=torch.int64)
        """Tokens routed to each logical expert from this rank since the last reset (for EPLB)."""
        self.computed_tokens = 0
        """Tokens this rank's experts computed (its share of the group's expert load)."""
        self.set_placement(placement, [moe.experts[e] for e in placement.slots[rank]])

    def set_placement(self, placement: ExpertPlacement, local_experts: list[nn.Module]) -> None:
        """Between steps: new slots for every rank and this rank's experts in its slot order."""
        assert len(local_experts) == placement.slots_per_rank
        self.placement = placement
        self.experts = nn.ModuleList(local_experts)
        # one stack of this rank's experts (their parameters re-pointed at it, so the whole layer's
        # stack they came from is freed): one grouped matmul, as the single-process MoE runs them
        self.grouped = GroupedExperts.stack(local_experts, share=True)
        replicas = placement.replicas()
        width = max(len(r) for r in replicas)
        self.num_copies = torch.tensor([len(r) for r in replicas], dtype=torch.int64)  # [E]
        self.copy_table = torch.tensor([r + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return run_to_end(self.steps(x))

    def idle(self) -> None:
        """This rank has no tokens this step, but its group's all-to-alls still need it."""
        weight = self.gate.weight
        self.forward(torch.empty(0, weight.shape[1], dtype=self._dtype(), device=weight.device))

    def _dtype(self) -> torch.dtype:
        return self.grouped.down.dtype

    def steps(self, x: torch.Tensor, peer_tokens: list[int] | None = None) -> Steps:
        """x [T, hidden] -> [T, hidden]; yields after each all-to-all launch. peer_tokens: this
        micro-batch's token count on every rank (the same list everywhere); with it, a small exchange
        sends counts and tokens in one padded all-to-all instead of two (see _capacities)."""
        num_ranks, num_slots = self.placement.ep_size, self.placement.slots_per_rank
        ids, weights = self._route(x)  # [T, k] each
        top_k = ids.shape[1]
        flat = ids.flatten()  # [T*k]
        self.expert_tokens += torch.bincount(flat, minlength=self.placement.num_experts)
        phys = self._physical_slots(flat, top_k)  # [T*k] global slot of each assignment
        order = phys.argsort(stable=True)  # by rank, then local slot, then token
        rows = order // top_k  # [T*k] token row of each sorted assignment
        send_counts = torch.bincount(phys, minlength=num_ranks * num_slots).view(num_ranks, num_slots)
        capacities = self._capacities(peer_tokens, top_k, x)
        if capacities is None:
            exchange = self._dispatch_counted(x[rows], send_counts, x)
        else:
            exchange = self._dispatch_padded(x[rows], send_counts, capacities)
        recv_counts, received, block_starts, shared, own = yield from exchange
        recv_rows = recv_counts.sum(1)  # [n]
        compact_starts = ep_layout.exclusive_cumsum(recv_rows)
        if own is not None:  # our own rows' outputs are there already: the experts run on the rest
            recv_counts = recv_counts.index_fill(0, torch.tensor([self.rank], device=x.device), 0)
        layouts = torch.stack([block_starts, compact_starts])  # as received, compact
        (expert_rows, source_rows), ends = ep_layout.slot_major_rows(recv_counts, layouts)
        hidden = self._run_experts(received[expert_rows], ends)  # [R, hidden] slot-major
        computed = hidden.new_empty(int(recv_rows.sum()), hidden.shape[1])  # each source's order, no padding
        computed[source_rows] = hidden
        if own is not None:
            start = int(compact_starts[self.rank])
            computed[start : start + len(own)] = own
        recv_splits = recv_rows.tolist()
        back = x.new_empty(len(rows), x.shape[1])
        combine = self._launch(back, computed, send_counts.sum(1).tolist(), recv_splits)
        if shared is None:  # the shared experts need no other rank: they compute while the outputs travel
            shared = self._shared(x)
        yield
        self._wait(combine, "combine")
        out = torch.zeros_like(x).index_add_(0, rows, back * weights.flatten()[order, None].to(x.dtype))
        return out if shared is None else out + shared

    def _capacities(self, peer_tokens: list[int] | None, top_k: int, x: torch.Tensor) -> list[int] | None:
        """Rows each rank may send any one rank (a token reaches at most min(k, slots) slots of a
        rank), when padding every block to that is cheap; None: count first, then send exactly.
        Small exchanges are latency-bound, so one collective with padding beats two; big ones are
        bandwidth-bound and padding would cost more than the round trip it saves. Every rank
        decides alike: the same peer_tokens, the same shapes."""
        if peer_tokens is None:
            return None
        per_token = min(top_k, self.placement.slots_per_rank)
        capacities = [tokens * per_token for tokens in peer_tokens]
        row_bytes = x.shape[1] * x.element_size()
        padded_bytes = len(capacities) * (1 + max(capacities)) * row_bytes
        return capacities if padded_bytes <= PADDED_EXCHANGE_MAX_BYTES else None

    def _dispatch_counted(self, sent: torch.Tensor, send_counts: torch.Tensor, x: torch.Tensor) -> Exchange:
        """Two all-to-alls: the per-slot counts, then exactly the rows. While the rows travel, this
        rank's experts run on its own rows (they need no other rank): the other micro-batch's
        segment in that window was its shared experts only, which left the counts and the rows
        exposed; the shared experts now cover the combine, whose window the other micro-batch fills
        with only its experts on other ranks' rows (profiled: ops/bench/ep/README.md)."""
        recv_counts = torch.empty_like(send_counts)
        yield from self._all_to_all("counts", recv_counts, send_counts)
        recv_splits = recv_counts.sum(1).tolist()
        send_splits = send_counts.sum(1).tolist()
        received = sent.new_empty(sum(recv_splits), sent.shape[1])
        work = self._launch(received, sent, recv_splits, send_splits)
        own_start = sum(send_splits[: self.rank])
        own_rows = sent[own_start : own_start + send_splits[self.rank]]  # slot-sorted, as sent to ourselves
        own = self._run_experts(own_rows, send_counts[self.rank].cumsum(0).to(torch.int32))
        yield
        self._wait(work, "dispatch")
        starts = ep_layout.exclusive_cumsum(torch.tensor(recv_splits, device=sent.device))
        return recv_counts, received, starts, None, own

    def _dispatch_padded(self, sent: torch.Tensor, send_counts: torch.Tensor, capacities: list[int]) -> Exchange:
        """One all-to-all: to each rank a header row of counts, then its rows, padded to our capacity."""
        num_ranks, num_slots = send_counts.shape
        block = 1 + capacities[self.rank]
        buffer = sent.new_empty(num_ranks * block, sent.shape[1])
        buffer[ep_layout.padded_positions(send_counts.sum(1), block)] = sent
        ep_layout.header_view(buffer[::block], num_slots).copy_(send_counts)
        recv_blocks = [1 + capacity for capacity in capacities]
        received = sent.new_empty(sum(recv_blocks), sent.shape[1])
        yield from self._all_to_all("dispatch", received, buffer, recv_blocks, [block] * num_ranks)
        headers = ep_layout.exclusive_cumsum(torch.tensor(recv_blocks, device=sent.device))  # [n]
        recv_counts = ep_layout.header_view(received[headers], num_slots).to(torch.int64)
        return recv_counts, received, headers + 1, None, None

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(x) if self.shared_experts is not None and len(x) else None

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(x):
            return self.gate(x)
        top_k = self.gate.top_k
        return x.new_empty(0, top_k, dtype=torch.int64), x.new_empty(0, top_k, dtype=torch.float32)

    def _physical_slots(self, flat_ids: torch.Tensor, top_k: int) -> torch.Tensor:
        """A hot expert's copies share its tokens: token row (offset by rank) modulo its copies."""
        rows = torch.arange(len(flat_ids), device=flat_ids.device) // top_k + self.rank
        return self.copy_table[flat_ids, rows % self.num_copies[flat_ids]]

    def _run_experts(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows [R, hidden] grouped by local slot, ends [S] -> [R, hidden]: each slot's expert on its rows."""
        self.computed_tokens += len(rows)
        hidden = silu_and_mul(self.grouped._matmul(rows, self.grouped.gate_up, ends), self.grouped.backend == "cpu")
        return self.grouped._matmul(hidden, self.grouped.down, ends)

    def _all_to_all(
        self,
        kind: str,
        output: torch.Tensor,
        data: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
    ) -> Generator[None, None, None]:
        work = self._launch(output, data, output_splits, input_splits)
        yield
        self._wait(work, kind)

    def _launch(
        self,
        output: torch.Tensor,
        data: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
    ) -> dist.Work:
        return dist.all_to_all_single(
            output, data.contiguous(), output_splits, input_splits, group=self.group, async_op=True
        )

    def _wait(self, work: dist.Work, kind: str) -> None:
        start = time.perf_counter()
        work.wait()
        waited = time.perf_counter() - start
        self.comm_wait_s += waited
        self.comm_wait_by_kind[kind] = self.comm_wait_by_kind.get(kind, 0.0) + waited

"""Expert-parallel DeepSeek-V3 MoE: this rank holds some routed experts, every rank the router and
the shared experts. Tokens go to the ranks holding their experts and come back by all-to-all.

One layer's communication: the dispatch sends each token to the ranks holding its experts, the
combine brings the experts' outputs back to where the token lives (all_to_all_single, async_op=True).
A receiver must know how many rows come before it can post the dispatch. Given every rank's token
count of this micro-batch (one small all-gather per step, by the runner), each rank sends every
other rank its whole micro-batch, one row per token tagged with the token's slots and weights there:
sizes every rank knows, no counts round trip, one collective; the receiver sums each token's
experts, so the combine returns one row per token as well. Without the counts (or when padding
would cost too much) the per-slot counts go first, then exactly the (token, expert) rows. `steps`
is a generator that yields right after each launch, so a driver can run another micro-batch's
compute before it waits; what needs no other rank fills the windows: the shared experts the
combine's, and in the counted exchange this rank's experts on its own rows the rows'. `forward`
just runs it through.
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
Exchange = Generator[None, None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""The counted dispatch: yields at its launches; -> (counts received [n, S], rows received, this
rank's experts' output on the rows it sent itself, in the order sent)."""

PADDED_EXCHANGE_MAX_RANKS_PER_TOP_K = 1.0
"""The padded exchange whatever its size while ep_size <= this * top_k (it sends no more rows than
the exact one then)."""
PADDED_EXCHANGE_MAX_BYTES = 1 << 20
"""Beyond that, the padded exchange while one rank's padded dispatch is at most this big."""


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
        """The same seconds by collective: counts, dispatch (exact rows, or padded tagged rows), combine."""
        self.comm_waits: list[float] | None = None
        """When a list (a benchmark sets one per step): the same seconds, one per wait() in order
        (every rank waits on the same collectives in the same order, so the i-th entries of two ranks
        are the same collective). None while serving: a list kept for every step would only grow."""
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
        micro-batch's token count on every rank (the same list everywhere); with it, the exchange's
        sizes are known before it starts and one padded all-to-all replaces counts-then-rows (_pads)."""
        ids, weights = self._route(x)  # [T, k] each
        top_k = ids.shape[1]
        flat = ids.flatten()  # [T*k]
        self.expert_tokens += torch.bincount(flat, minlength=self.placement.num_experts)
        phys = self._physical_slots(flat, top_k)  # [T*k] global slot of each assignment
        if peer_tokens is not None and self._pads(peer_tokens, top_k, x):
            routed, shared = yield from self._exchange_padded(x, phys.view_as(ids), weights, peer_tokens)
        else:
            routed, shared = yield from self._exchange_counted(x, phys, weights)
        return routed if shared is None else routed + shared

    def _pads(self, peer_tokens: list[int], top_k: int, x: torch.Tensor) -> bool:
        """Padded: every rank sends every other rank its whole micro-batch (one row per token, tagged
        with the token's slots there), so no one waits for counts first. A token has top_k
        assignments, so the exact exchange sends up to top_k rows a token and the padded one
        ep_size - 1: when ep_size <= top_k padding costs no more than exactness; beyond, it pays
        only while the exchange is small (latency-bound). Every rank decides alike: the same
        peer_tokens, the same shapes."""
        num_ranks = self.placement.ep_size
        if num_ranks <= PADDED_EXCHANGE_MAX_RANKS_PER_TOP_K * top_k:
            return True
        padded_bytes = num_ranks * max(peer_tokens) * x.shape[1] * x.element_size()
        return padded_bytes <= PADDED_EXCHANGE_MAX_BYTES

    def _exchange_padded(
        self, x: torch.Tensor, phys: torch.Tensor, weights: torch.Tensor, peer_tokens: list[int]
    ) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor | None]]:
        """x [T, hidden], phys/weights [T, k] -> (routed output [T, hidden], shared experts' output).
        Dispatch: to each other rank all T rows tagged (ep_layout.tag_rows); its sizes are every
        rank's token count, known to all, and its window is the other micro-batch's attention. The
        receiver runs its experts on the tagged assignments and its own in one pass and sums each
        token's weighted outputs, so the combine returns one row per token too (the shared experts
        in its window); each token's output is the sum of the ranks' partial sums in rank order."""
        num_ranks, num_slots = self.placement.ep_size, self.placement.slots_per_rank
        others = [r for r in range(num_ranks) if r != self.rank]
        dest, local = phys // num_slots, phys % num_slots  # [T, k] each
        slots = (
            torch.stack([local.masked_fill(dest != r, -1) for r in others])
            if others
            else local.new_empty(0, *local.shape)
        )
        sent = ep_layout.tag_rows(x, slots, weights)  # [(n-1)*T, W]
        send_splits = [0 if r == self.rank else len(x) for r in range(num_ranks)]
        recv_splits = [0 if r == self.rank else peer_tokens[r] for r in range(num_ranks)]
        received = sent.new_empty(sum(recv_splits), sent.shape[1])
        dispatch = self._launch(received, sent, recv_splits, send_splits)
        yield
        self._wait(dispatch, "dispatch")
        # this rank's own assignments join the received ones: one pass over its experts' weights
        # (two passes cost twice the weight reads, what a decode-sized step is bound by)
        received_x, received_slots, received_weights = ep_layout.untag_rows(received, x.shape[1], phys.shape[1])
        both = self._weighted_experts(
            torch.cat([x, received_x]),
            torch.cat([local.masked_fill(dest != self.rank, -1), received_slots]),
            torch.cat([weights.float(), received_weights]),
        )
        own, computed = both[: len(x)], both[len(x) :]
        back = x.new_empty(len(sent), x.shape[1])
        combine = self._launch(back, computed, send_splits, recv_splits)
        shared = self._shared(x)
        yield
        self._wait(combine, "combine")
        partials = list(back.view(len(others), len(x), x.shape[1]).unbind())
        partials.insert(self.rank, own)
        out = partials[0].clone()
        for partial in partials[1:]:
            out += partial
        return out, shared

    def _weighted_experts(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [R, hidden], slots [R, k] local slot of each assignment (-1: not this rank's), weights
        [R, k] -> [R, hidden]: each row's weighted sum over its assignments here, in slot order."""
        flat = slots.flatten()
        picked = (flat >= 0).nonzero().squeeze(1)
        picked = picked[flat[picked].argsort(stable=True)]  # [P] this rank's assignments, by slot
        rows = picked // slots.shape[1]
        ends = torch.bincount(flat[picked], minlength=self.placement.slots_per_rank).cumsum(0).to(torch.int32)
        hidden = self._run_experts(x[rows], ends)  # [P, hidden]
        hidden = hidden * weights.flatten()[picked, None].to(hidden.dtype)
        return torch.zeros_like(x).index_add_(0, rows, hidden)

    def _exchange_counted(
        self, x: torch.Tensor, phys: torch.Tensor, weights: torch.Tensor
    ) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor | None]]:
        """x [T, hidden], phys/weights [T*k]/[T, k] -> (routed output, shared experts' output): every
        (token, expert) row goes to its rank, exactly, after the per-slot counts."""
        num_ranks, num_slots = self.placement.ep_size, self.placement.slots_per_rank
        top_k = weights.shape[1]
        order = phys.argsort(stable=True)  # by rank, then local slot, then token
        rows = order // top_k  # [T*k] token row of each sorted assignment
        send_counts = torch.bincount(phys, minlength=num_ranks * num_slots).view(num_ranks, num_slots)
        recv_counts, received, own = yield from self._dispatch_counted(x[rows], send_counts)
        recv_rows = recv_counts.sum(1)  # [n]
        starts = ep_layout.exclusive_cumsum(recv_rows)
        # our own rows' outputs are there already: the experts run on the rest
        recv_counts = recv_counts.index_fill(0, torch.tensor([self.rank], device=x.device), 0)
        (expert_rows,), ends = ep_layout.slot_major_rows(recv_counts, starts[None])
        hidden = self._run_experts(received[expert_rows], ends)  # [R, hidden] slot-major
        computed = hidden.new_empty(int(recv_rows.sum()), hidden.shape[1])  # each source's order
        computed[expert_rows] = hidden
        start = int(starts[self.rank])
        computed[start : start + len(own)] = own
        back = x.new_empty(len(rows), x.shape[1])
        combine = self._launch(back, computed, send_counts.sum(1).tolist(), recv_rows.tolist())
        shared = self._shared(x)  # the shared experts need no other rank: they compute while the outputs travel
        yield
        self._wait(combine, "combine")
        out = torch.zeros_like(x).index_add_(0, rows, back * weights.flatten()[order, None].to(x.dtype))
        return out, shared

    def _dispatch_counted(self, sent: torch.Tensor, send_counts: torch.Tensor) -> Exchange:
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
        return recv_counts, received, own

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
        if self.comm_waits is not None:
            self.comm_waits.append(waited)

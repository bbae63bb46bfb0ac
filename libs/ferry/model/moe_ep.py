"""Expert-parallel DeepSeek-V3 MoE: this rank holds some routed experts, every rank the router and
the shared experts. Tokens go to the ranks holding their experts and come back by all-to-all.

One layer's communication, in order: the per-slot token counts (all_to_all_single of n*S ints),
then the tokens themselves (dispatch), then the experts' outputs back to where the tokens live
(combine). `steps` is a generator that yields right after launching each of them (async_op=True),
so a driver can run another micro-batch's compute before it waits; `forward` just runs it through.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ferry.kernels import silu_and_mul
from ferry.model.grouped_experts import GroupedExperts
from ferry.model.moe import MoE, Router
from ferry.parallel.placement import ExpertPlacement

Steps = Generator[None, None, torch.Tensor]


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

    def steps(self, x: torch.Tensor) -> Steps:
        """x [T, hidden] -> [T, hidden]; yields after each all-to-all launch."""
        num_ranks, num_slots = self.placement.ep_size, self.placement.slots_per_rank
        ids, weights = self._route(x)  # [T, k] each
        top_k = ids.shape[1]
        flat = ids.flatten()  # [T*k]
        self.expert_tokens += torch.bincount(flat, minlength=self.placement.num_experts)
        phys = self._physical_slots(flat, top_k)  # [T*k] global slot of each assignment
        order = phys.argsort(stable=True)  # by rank, then local slot, then token
        send_counts = torch.bincount(phys, minlength=num_ranks * num_slots)  # [n*S]
        recv_counts = torch.empty_like(send_counts)
        yield from self._all_to_all(recv_counts, send_counts)
        send_splits = send_counts.view(num_ranks, num_slots).sum(1).tolist()
        recv_splits = recv_counts.view(num_ranks, num_slots).sum(1).tolist()
        received = x.new_empty(sum(recv_splits), x.shape[1])
        dispatch = self._launch(received, x[order // top_k], recv_splits, send_splits)
        # the shared experts need no other rank: they compute while the tokens travel
        shared = self.shared_experts(x) if self.shared_experts is not None and len(x) else None
        yield
        self._wait(dispatch)
        computed = self._run_experts(received, recv_counts.view(num_ranks, num_slots))
        back = x.new_empty(len(order), x.shape[1])
        yield from self._all_to_all(back, computed, send_splits, recv_splits)
        out = torch.zeros_like(x)
        out.index_add_(0, order // top_k, back * weights.flatten()[order, None].to(x.dtype))
        return out if shared is None else out + shared

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(x):
            return self.gate(x)
        top_k = self.gate.top_k
        return x.new_empty(0, top_k, dtype=torch.int64), x.new_empty(0, top_k, dtype=torch.float32)

    def _physical_slots(self, flat_ids: torch.Tensor, top_k: int) -> torch.Tensor:
        """A hot expert's copies share its tokens: token row (offset by rank) modulo its copies."""
        rows = torch.arange(len(flat_ids), device=flat_ids.device) // top_k + self.rank
        return self.copy_table[flat_ids, rows % self.num_copies[flat_ids]]

    def _run_experts(self, received: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """received [R, hidden]: per source rank, its rows grouped by our local slot (counts [n, S])."""
        num_slots = counts.shape[1]
        slots = torch.arange(num_slots, device=counts.device).repeat(counts.shape[0])
        slot_of_row = torch.repeat_interleave(slots, counts.flatten())  # [R]
        by_slot = slot_of_row.argsort(stable=True)
        ends = counts.sum(0).cumsum(0).to(torch.int32)  # [S] end of each slot's rows, sorted
        self.computed_tokens += len(received)
        fused = self.grouped.backend == "cpu"
        hidden = silu_and_mul(self.grouped._matmul(received[by_slot], self.grouped.gate_up, ends), fused)
        out = torch.empty_like(received)
        out[by_slot] = self.grouped._matmul(hidden, self.grouped.down, ends)
        return out

    def _all_to_all(
        self,
        output: torch.Tensor,
        data: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
    ) -> Generator[None, None, None]:
        work = self._launch(output, data, output_splits, input_splits)
        yield
        self._wait(work)

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

    def _wait(self, work: dist.Work) -> None:
        start = time.perf_counter()
        work.wait()
        self.comm_wait_s += time.perf_counter() - start

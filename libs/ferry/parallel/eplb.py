"""Expert-parallel load balancer (EPLB): which experts get redundant copies and which rank holds
each copy, from the tokens each expert received over a sliding window of steps. No torch.

The hierarchical policy (the seed's, our own code): 1. expert groups are packed onto nodes so node
loads even out (a token's experts come from few groups, so keeping groups whole keeps its traffic
mostly inside one node); 2. inside each node the spare slots go, one at a time, to the expert with
the highest load per copy; 3. the node's copies are packed onto its ranks, heaviest first onto the
lightest rank with a free slot, so every rank holds the same number of slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ferry.parallel.placement import ExpertPlacement


@dataclass(frozen=True, slots=True)
class EplbConfig:
    every_steps: int = 64
    """Re-place experts after every this many steps (between steps, so no request is dropped)."""
    window_steps: int = 256
    """Steps of per-expert token counts the placement is computed from."""
    redundant_slots_per_rank: int = 1
    """Slots each rank holds beyond its even share (num_experts / ep_size): room for copies."""
    num_nodes: int = 1
    """Nodes the group spans; > 1 keeps expert groups whole on a node (the hierarchical policy)."""

    def __post_init__(self) -> None:
        for name in ("every_steps", "window_steps", "num_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.redundant_slots_per_rank < 0:
            raise ValueError(f"redundant_slots_per_rank: must be >= 0, got {self.redundant_slots_per_rank}")


class ExpertLoadWindow:
    """Per-expert token counts of the last window_steps steps."""

    def __init__(self, num_experts: int, window_steps: int) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps: must be >= 1, got {window_steps}")
        self.num_experts = num_experts
        self.steps: deque[list[int]] = deque(maxlen=window_steps)

    def record(self, counts: Sequence[int]) -> None:
        if len(counts) != self.num_experts:
            raise ValueError(f"counts: {len(counts)} entries for {self.num_experts} experts")
        self.steps.append(list(counts))

    def loads(self) -> list[int]:
        return [sum(step[e] for step in self.steps) for e in range(self.num_experts)]


def balanced_packing(weights: Sequence[float], num_bins: int, per_bin: int) -> list[list[int]]:
    """Items (indices into weights) into num_bins bins of exactly per_bin items each: heaviest first,
    each onto the lightest bin with room."""
    assert len(weights) == num_bins * per_bin
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    totals = [0.0] * num_bins
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min((b for b in range(num_bins) if len(bins[b]) < per_bin), key=lambda b: (totals[b], b))
        bins[target].append(item)
        totals[target] += weights[item]
    return bins


def replicate(loads: Sequence[float], num_slots: int) -> list[int]:
    """Copies per expert for num_slots slots (>= experts): each spare slot to the expert whose load
    per copy is highest."""
    assert num_slots >= len(loads)
    copies = [1] * len(loads)
    for _ in range(num_slots - len(loads)):
        hottest = max(range(len(loads)), key=lambda e: (loads[e] / copies[e], -e))
        copies[hottest] += 1
    return copies


def hierarchical_placement(
    loads: Sequence[float], ep_size: int, slots_per_rank: int, num_groups: int = 1, num_nodes: int = 1
) -> ExpertPlacement:
    """A placement of len(loads) experts on ep_size ranks of slots_per_rank slots each."""
    num_experts = len(loads)
    _check(num_experts, ep_size, slots_per_rank, num_groups, num_nodes)
    group_size, ranks_per_node = num_experts // num_groups, ep_size // num_nodes
    group_loads = [sum(loads[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    slots: list[tuple[int, ...]] = []
    for node_groups in balanced_packing(group_loads, num_nodes, num_groups // num_nodes):
        experts = [g * group_size + i for g in sorted(node_groups) for i in range(group_size)]
        copies = replicate([loads[e] for e in experts], ranks_per_node * slots_per_rank)
        physical = [e for e, n in zip(experts, copies) for _ in range(n)]
        copies_of = dict(zip(experts, copies))
        per_copy = [loads[e] / copies_of[e] for e in physical]
        for items in balanced_packing(per_copy, ranks_per_node, slots_per_rank):
            slots.append(tuple(sorted(physical[i] for i in items)))
    return ExpertPlacement(num_experts, tuple(slots))


def _check(num_experts: int, ep_size: int, slots_per_rank: int, num_groups: int, num_nodes: int) -> None:
    if num_experts % num_groups:
        raise ValueError(f"num_groups: {num_groups} does not divide the {num_experts} experts")
    if num_groups % num_nodes or ep_size % num_nodes:
        raise ValueError(f"num_nodes: {num_nodes} must divide num_groups ({num_groups}) and ep_size ({ep_size})")
    if (ep_size // num_nodes) * slots_per_rank < num_experts // num_nodes:
        raise ValueError(
            f"slots_per_rank: {slots_per_rank} x {ep_size // num_nodes} ranks per node cannot hold "
            f"the node's {num_experts // num_nodes} experts"
        )

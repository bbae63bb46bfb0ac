"""ExpertPlacement: which logical expert each physical expert slot of each rank holds. No torch.

A rank holds `slots_per_rank` physical experts; a logical expert may sit in several slots (a
redundant copy of a hot expert), and then its tokens are spread over its copies. Physical slot p
is global: rank p // slots_per_rank, local slot p % slots_per_rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    num_experts: int
    """Logical (routed) experts of the model."""
    slots: tuple[tuple[int, ...], ...]
    """slots[rank][local slot] = logical expert id held there."""

    def __post_init__(self) -> None:
        if not self.slots or len({len(s) for s in self.slots}) != 1 or not self.slots[0]:
            raise ValueError("slots: every rank needs the same, non-zero number of slots")
        held = {e for rank in self.slots for e in rank}
        if held != set(range(self.num_experts)):
            missing = sorted(set(range(self.num_experts)) - held)
            raise ValueError(f"slots: experts {missing[:8]} are held by no rank" if missing else "slots: unknown ids")

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Rank r holds experts [r*E/n, (r+1)*E/n): the placement without load balancing."""
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size: {ep_size} must divide the {num_experts} routed experts")
        per = num_experts // ep_size
        return cls(num_experts, tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep_size)))

    @property
    def ep_size(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    def replicas(self) -> list[list[int]]:
        """[logical expert] -> its global physical slots, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for rank, held in enumerate(self.slots):
            for local, expert in enumerate(held):
                out[expert].append(rank * self.slots_per_rank + local)
        return out

    def rank_loads(self, expert_loads: Sequence[float]) -> list[float]:
        """Tokens each rank computes when each expert's load splits evenly over its copies."""
        copies = [len(r) for r in self.replicas()]
        return [sum(expert_loads[e] / copies[e] for e in held) for held in self.slots]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0 = perfectly balanced)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
